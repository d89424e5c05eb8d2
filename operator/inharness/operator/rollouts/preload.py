"""The preload process ("zygote") of local rollouts: imports a pool's `spec.local.preload` modules
once, then forks each attempt's `python SCRIPT args` / `python -m MODULE args` from itself.

Why: a harness's interpreter start is mostly imports (`import openai` alone costs ~0.8 s of CPU),
paid again by every attempt; a fork of a process that has them costs a few milliseconds.

Run as a script by the controller (`local.Zygote`), never imported by it: everything it imports is
already imported in each child, so it imports little. Its stdin/stdout are the control pipe, JSON
lines: it first says {"ready": true} or {"error": why}; then for each request {id, argv (after
`python`), env, cwd, stdin, stdout, stderr (paths)} it answers {id, pid} or {id, error}, and
{id, exit} once the child ended (negative: killed by that signal, as in subprocess). EOF on stdin
ends it, after killing the process groups of any children still running (the controller normally
has ended them). It ignores SIGINT and SIGTERM: a Ctrl-C stops the controller, which ends it.

A child is set up like a fresh interpreter: own session (so the controller's killpg works as for
exec), the attempt's cwd, environment and stdio, sys.argv, sys.path[0], default signal handlers,
`__name__ == "__main__"`, exit codes as the interpreter's (SystemExit, traceback and 1). What
differs from exec: modules imported here are already imported (their import-time side effects
happened once, in this process; their global state, such as a library's random generator, starts
equal in every attempt), Python's own start-up settings (PYTHON* variables, -X options, the str hash
seed) are this process's, and sys.argv[0] and `__file__` are the script's absolute path.
"""

import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import sys
from typing import Any, NoReturn


def main(modules: list[str]) -> int:
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # what preloaded code prints must not corrupt the control pipe
    sys.path[0] = os.getcwd()  # as for `python -m`, not this file's folder
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as exc:
        _send(ctl_out, {"error": f"cannot import {name}: {type(exc).__name__}: {exc}"})
        return 1
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        _send(ctl_out, {"error": f"preloading left {threads} threads running; a fork copies only one"})
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _send(ctl_out, {"ready": True})
    _serve(ctl_in, ctl_out)
    return 0


def _serve(ctl_in: int, ctl_out: int) -> None:
    """One thread: a selector on the control pipe and on a wakeup pipe that SIGCHLD writes to."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(ctl_in, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    inherited = [ctl_in, ctl_out, wake_r, wake_w, sel.fileno()]
    children: dict[int, str] = {}
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                while _read(wake_r):
                    pass
                continue
            data = os.read(ctl_in, 1 << 16)
            if not data:
                _end(children)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                reply = _spawn(request, inherited, children)
                _send(ctl_out, {"id": request["id"], **reply})
        _reap(children, ctl_out)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 512)
    except BlockingIOError:
        return b""


def _spawn(request: dict[str, Any], inherited: list[int], children: dict[int, str]) -> dict[str, Any]:
    """Open the child's cwd and stdio here, so that a bad path is an error reply (as exec's OSError
    is), then fork."""
    fds: list[int] = []
    try:
        fds.append(os.open(request["cwd"], os.O_RDONLY | os.O_DIRECTORY))
        fds.append(os.open(request["stdin"], os.O_RDONLY))
        for path in (request["stdout"], request["stderr"]):
            fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, inherited)
    except OSError as exc:
        return {"error": str(exc)}
    finally:
        for fd in fds:
            os.close(fd)
    children[pid] = request["id"]
    return {"pid": pid}


def _child(request: dict[str, Any], fds: list[int], inherited: list[int]) -> NoReturn:
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        cwd, *stdio = fds
        os.fchdir(cwd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in [*fds, *inherited]:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_stdio()
        code = _run_main(request["argv"])
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        _flush()
        os._exit(code)


def _fresh_stdio() -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, configured as this interpreter configured its own
    (buffering, encoding, errors: PYTHONUNBUFFERED, PYTHONIOENCODING and the locale as at its start)."""
    for name, fd, mode in (("stdin", 0, "rb"), ("stdout", 1, "wb"), ("stderr", 2, "wb")):
        old = getattr(sys, name)
        unbuffered = isinstance(old.buffer, io.FileIO)
        binary = open(fd, mode, buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        new = io.TextIOWrapper(
            binary,
            encoding=old.encoding,
            errors=old.errors,
            newline="\n",
            line_buffering=old.line_buffering,
            write_through=old.write_through,
        )
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _run_main(argv: list[str]) -> int:
    """Run `SCRIPT args` or `-m MODULE args` as __main__; the exit code the interpreter would give."""
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
        module = argv[1]
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = os.path.abspath(argv[0])
        if not os.path.exists(script):
            print(
                f"{sys.executable}: can't open file {script!r}: [Errno 2] No such file or directory",
                file=sys.stderr,
            )
            return 2
        sys.argv = [script, *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finalize()
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _finalize() -> None:
    """What the interpreter does at exit before flushing stdio: join non-daemon threads, run atexit
    callbacks."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit hook
    atexit._run_exitfuncs()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _reap(children: dict[int, str], ctl_out: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        attempt = children.pop(pid, None)
        if attempt is not None:
            _send(ctl_out, {"id": attempt, "exit": os.waitstatus_to_exitcode(status)})


def _end(children: dict[int, str]) -> None:
    """The controller is gone: nobody will end these children's groups but us."""
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


def _send(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
