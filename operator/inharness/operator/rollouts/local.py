"""Local rollout backend: each claimed attempt runs the harness as a child process of this one.

Each harness (and grader) gets its own process group, so a timeout, a stop or a lost lease ends it
together with whatever it started; nothing is left running once an attempt is reported. Files of an
attempt (task, result, stdout, stderr) stay in `work_dir/<attempt id>/` for inspection.

With `spec.local.preload`, a `python SCRIPT` harness is forked from a preload process (`Zygote`,
preload.py) that imported those modules once, instead of exec'd; either way `_run` gets a pid that
leads its own process group and an awaitable exit code, and ends the group the same way.
"""

import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator.render.harness import KEY_PLACEHOLDER
from inharness.operator.rollouts.base import (
    Abort,
    ClaimingController,
    OnFinish,
    Outage,
    RunnerFault,
    pool_settings,
)
from inharness.operator.rollouts.outcome import NoReward, Outcome, parse_result
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec
from inharness.procs import die_with_parent

__all__ = [
    "KEY_PLACEHOLDER",
    "LocalRolloutController",
    "NoReward",
    "Zygote",
    "parse_result",
    "preload_refusal",
]

STDERR_TAIL_BYTES = 2048
LOG_TAIL_BYTES, LOG_TAIL_LINES, LOG_TAIL_LINE_CHARS = 4096, 12, 240  # what a halted run prints of stderr.log
MAX_RESULT_BYTES = 1 << 20
PRELOAD_SCRIPT = Path(__file__).with_name("preload.py")


class _Failed(Exception):
    """An attempt that ends in a failure with this reason."""


class _NoReward(_Failed):
    """The harness's result has no reward (no file, or JSON without one); `rest`: its other keys."""

    def __init__(self, reason: str, rest: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.rest = rest or {}


@dataclass(frozen=True)
class _Exit:
    """How one child process ended."""

    how: Literal["exited", "timeout", "aborted", "unstartable", "lost"]
    code: int | None = None
    error: str = ""


class LocalRolloutController(ClaimingController):
    """Runs a RolloutPool's attempts as local harness processes (see `ClaimingController`)."""

    def __init__(
        self,
        gateway: GatewayClient,
        gateway_url: str,
        pool_name: str,
        pool: RolloutPoolSpec,
        harness: HarnessSpecSpec,
        base_dir: Path,
        work_dir: Path,
        *,
        log: Callable[[str], None] | None = None,
        on_finish: OnFinish | None = None,
        kill_grace_seconds: float = 5.0,
        max_consecutive_failures: int = 0,
        outage: Outage | None = None,
    ) -> None:
        super().__init__(
            gateway,
            pool_name,
            **pool_settings(pool, harness),
            log=log,
            on_finish=on_finish,
            max_consecutive_failures=max_consecutive_failures,
            outage=outage,
        )
        self.gateway_url = gateway_url.rstrip("/")
        self.pool = pool
        self.harness = harness
        # Absolute once, here: a harness runs in `cwd` (and a forked one opens its files after changing
        # into it), so every path it or its runner is given must not depend on the caller's directory.
        self.base_dir = _absolute(base_dir)
        self.work_dir = _absolute(work_dir)
        self.kill_grace_seconds = kill_grace_seconds
        wd = Path(harness.working_dir).expanduser() if harness.working_dir else None
        self.cwd = self.base_dir if wd is None else _absolute(self.base_dir / wd)
        self._zygote: Zygote | None = None
        self._zygote_lock = asyncio.Lock()
        if pool.local.preload:
            base_env = {**os.environ, **{e.name: e.value for e in harness.env}}
            refusal = preload_refusal([*harness.command, *harness.args], base_env, self.cwd)
            if refusal is None:
                self._zygote = Zygote(pool.local.preload, self.cwd, self.work_dir / "preload.log")
            else:
                self.log(f"pool {pool_name}: spec.local.preload not used: {refusal}")

    async def end(self) -> None:
        if self._zygote is not None:
            await self._zygote.close()

    def logs_of(self, attempt_id: str) -> str:
        adir = self.work_dir / attempt_id
        return f"{adir / 'stderr.log'} (and stdout.log beside it)"

    def log_tail(self, attempt_id: str) -> list[str]:
        text = _tail(self.work_dir / attempt_id / "stderr.log", LOG_TAIL_BYTES)
        return [line[:LOG_TAIL_LINE_CHARS] for line in text.splitlines()[-LOG_TAIL_LINES:] if line.strip()]

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        adir = self.work_dir / attempt.id
        h, outcome = self.harness, self.harness.outcome
        result = adir / "result.json"
        try:
            adir.mkdir(parents=True, exist_ok=True)
            task_env = self._task_env(attempt, adir / "task.json")
            (adir / "stdout.log").touch()
        except OSError as exc:
            raise RunnerFault(f"cannot write the attempt's files in {self.work_dir}: {exc}") from exc
        env = {**os.environ, **{e.name: e.value for e in h.env}, **task_env}
        env.update(self._model_env(attempt.token))
        env["INHARNESS_ATTEMPT_ID"], env["INHARNESS_ROLLOUT_ID"] = attempt.id, attempt.rollout_id
        if outcome.type != "exitCode":
            env[outcome.result_file_env] = str(result)
        stdout, stderr = adir / "stdout.log", adir / "stderr.log"

        argv, zygote = [*h.command, *h.args], await self._ready_zygote()
        ran = await self._run(argv, env, stdout, stderr, h.timeout_seconds, abort, zygote=zygote)
        info: dict[str, Any] = {"exit_code": ran.code}
        try:
            self._check_ended(ran, h.timeout_seconds, abort, "")
            if outcome.type == "exitCode":
                return Outcome.success(1.0 if ran.code == 0 else 0.0, **info)
            if outcome.type == "resultFile":
                if ran.code != 0:
                    raise _Failed(f"exited with code {ran.code}")
                reward, rest = _read_result(result, "")
                return Outcome.success(reward, **info, **({"result": rest} if rest else {}))
            return await self._grade(attempt, adir, ran, stdout, result, abort, info)
        except _NoReward as missing:
            # A reward the harness posted to the gateway may stand in (ClaimingController).
            more = {"result": missing.rest} if missing.rest else {}
            return Outcome.missing_reward(str(missing), **info, **more, stderr_tail=_tail(stderr))
        except _Failed as failed:
            return Outcome.failure(str(failed), **info, stderr_tail=_tail(stderr))

    async def _grade(
        self,
        attempt: ClaimedAttempt,
        adir: Path,
        ran: _Exit,
        stdout: Path,
        result: Path,
        abort: Abort,
        info: dict[str, Any],
    ) -> Outcome:
        """The grader sees what the harness saw of its task, plus what the harness left behind; it
        does not get the model endpoint, so none of its own calls could be recorded as the policy's."""
        grader = self.harness.outcome.grader
        assert grader is not None
        graded = adir / "grader-result.json"
        env = self._grader_env(attempt, adir, ran, stdout, result, graded)
        g_err = adir / "grader.stderr.log"
        g = await self._run(
            list(grader.command), env, adir / "grader.stdout.log", g_err, grader.timeout_seconds, abort
        )
        try:
            self._check_ended(g, grader.timeout_seconds, abort, "grader ")
            if g.code != 0:
                raise _Failed(f"grader exited with code {g.code}")
            reward, rest = _read_result(graded, "grader ")
        except _Failed as failed:
            return Outcome.failure(str(failed), **info, grader_stderr_tail=_tail(g_err))
        return Outcome.success(reward, **info, **({"result": rest} if rest else {}))

    def _grader_env(
        self, attempt: ClaimedAttempt, adir: Path, ran: _Exit, stdout: Path, result: Path, graded: Path
    ) -> dict[str, str]:
        """Its own copy of the task and a result path cleared beforehand: what the harness (a policy
        being trained, prone to reward hacking) wrote into its files must not become the grade."""
        graded.unlink(missing_ok=True)
        env = {**os.environ, **{e.name: e.value for e in self.harness.env}}
        env.update(self._task_env(attempt, adir / "grader-task.json"))
        env["INHARNESS_ATTEMPT_ID"], env["INHARNESS_ROLLOUT_ID"] = attempt.id, attempt.rollout_id
        env["INHARNESS_EXIT_CODE"] = str(ran.code)
        env["INHARNESS_OUTPUT_FILE"] = str(stdout)
        env[self.harness.outcome.result_file_env] = str(graded)
        if result.is_file():
            env["INHARNESS_HARNESS_RESULT_FILE"] = str(result)
        return env

    @staticmethod
    def _check_ended(ran: _Exit, timeout: int, abort: Abort, who: str) -> None:
        """Raise the reason a process did not run to its own exit, or was killed by a signal."""
        if ran.how == "unstartable":
            raise _Failed(f"{who}could not start: {ran.error}")
        if ran.how == "lost":
            raise _Failed(f"{who}{ran.error}")
        if ran.how == "timeout":
            raise _Failed(f"{who}timed out after {timeout}s")
        if ran.how == "aborted":
            raise _Failed(abort.reason)
        if ran.code is not None and ran.code < 0:
            raise _Failed(f"{who}killed by signal {_signal_name(-ran.code)}")

    def _model_env(self, token: str) -> dict[str, str]:
        m = self.harness.model
        if m.key_in == "header":
            env = {m.base_url_env: f"{self.gateway_url}/v1", m.api_key_env: token}
        else:
            env = {m.base_url_env: f"{self.gateway_url}/t/{token}/v1", m.api_key_env: KEY_PLACEHOLDER}
        if m.model_name_env is not None:
            env[m.model_name_env] = m.model_name
        return env

    def _task_env(self, attempt: ClaimedAttempt, file: Path) -> dict[str, str]:
        t = self.harness.task
        task = json.dumps(attempt.task)
        env = {}
        if t.env is not None:
            env[t.env] = task
        if t.file_env is not None:
            file.write_text(task, encoding="utf-8")
            env[t.file_env] = str(file)
        return env

    async def _ready_zygote(self) -> "Zygote | None":
        """The running preload process, started (again) if need be; None: exec the harness."""
        async with self._zygote_lock:
            zygote = self._zygote
            if zygote is None or zygote.running:
                return zygote
            if zygote.ended:
                self.log(f"pool {self.pool_name}: {zygote.ended}; starting a new one")
            try:
                await zygote.start()
            except PreloadError as exc:
                self.log(f"pool {self.pool_name}: spec.local.preload not used: {exc}")
                self._zygote = None
                return None
            return zygote

    async def _run(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        limit_s: float,
        abort: Abort,
        *,
        zygote: "Zygote | None" = None,
    ) -> _Exit:
        """Run one child in its own process group until it exits, times out or is aborted; in every
        case (cancellation included) the whole group is gone when this returns."""
        try:
            pid, exit_code = await self._start(argv, env, stdout, stderr, zygote)
        except OSError as exc:
            return _Exit("unstartable", error=str(exc))
        except PreloadError as exc:
            return _Exit("lost", error=str(exc))
        exited = asyncio.ensure_future(exit_code)
        aborted = asyncio.create_task(abort.wait())
        how: Literal["exited", "timeout", "aborted"] = "timeout"
        try:
            done, _ = await asyncio.wait(
                {exited, aborted}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED
            )
            how = "exited" if exited in done else "aborted" if aborted in done else "timeout"
        finally:
            aborted.cancel()
            await self._end_group(pid, exited)
        lost = exited.exception()
        if lost is not None:
            return _Exit("lost" if how == "exited" else how, error=str(lost))
        return _Exit(how, exited.result())

    async def _start(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path, zygote: "Zygote | None"
    ) -> tuple[int, Awaitable[int]]:
        """(pid, its exit code) of a new process group leader running argv."""
        if zygote is not None:
            return await zygote.spawn(argv[1:], env, self.cwd, stdout, stderr)
        with stdout.open("wb") as out, stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.cwd,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=die_with_parent,  # a SIGKILLed runner leaves no harness behind
            )
        return proc.pid, proc.wait()

    async def _end_group(self, pgid: int, exited: "asyncio.Future[int]") -> None:
        """SIGTERM the group, give it the grace period, SIGKILL what is left. A group whose leader
        exited by itself only loses its stragglers."""
        if not exited.done():
            _killpg(pgid, signal.SIGTERM)
            await _poll_until(lambda: exited.done() and not _group_alive(pgid), self.kill_grace_seconds)
        if not exited.done() or _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
        await asyncio.wait([exited])

        def gone() -> bool:
            if not _group_alive(pgid):
                return True
            _killpg(pgid, signal.SIGKILL)
            return False

        if not await _poll_until(gone, 10.0):
            self.log(f"process group {pgid} still has live processes after SIGKILL")


class PreloadError(Exception):
    """The preload process cannot serve: it failed to start, or died."""


class Zygote:
    """Controller side of one preload process (preload.py): `spawn` forks a harness from it and
    gives its pid and exit code. Restartable: `start` again after it ended (`ended` says how)."""

    def __init__(self, modules: list[str], cwd: Path, log_file: Path) -> None:
        self.modules = modules
        self.cwd = cwd
        self.log_file = log_file
        self.ended = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._started: dict[str, asyncio.Future[int]] = {}
        self._exits: dict[str, asyncio.Future[int]] = {}
        self._ids = itertools.count()

    @property
    def running(self) -> bool:
        return self._reader is not None and not self._reader.done()

    async def start(self) -> None:
        """Start it and wait until its modules are imported; PreloadError says why it cannot serve.
        Its stderr (tracebacks, what preloaded code prints) goes to `log_file`."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(PRELOAD_SCRIPT),
                *self.modules,
                cwd=self.cwd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        hello = json.loads(line) if line else {"error": _ended(await proc.wait())}
        if "error" in hello:
            await _close(proc)
            raise PreloadError(f"preload process: {hello['error']} (log: {self.log_file})")
        self._proc, self.ended = proc, ""
        self._reader = asyncio.create_task(self._read(proc))

    async def spawn(
        self, args: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path
    ) -> tuple[int, "asyncio.Future[int]"]:
        """Run `python *args` forked: (pid, exit code). OSError where exec would raise one (a missing
        cwd), PreloadError when the preload process is gone; the exit code raises PreloadError if it
        dies before the child ends. A cancelled spawn kills its child's group once its pid arrives."""
        proc = self._proc
        if proc is None or not self.running:
            raise PreloadError(self.ended or "preload process not started")
        assert proc.stdin is not None
        key, loop = str(next(self._ids)), asyncio.get_running_loop()
        started, exited = loop.create_future(), loop.create_future()
        self._started[key], self._exits[key] = started, exited
        request = {"id": key, "argv": args, "env": env, "cwd": str(cwd), "stdin": os.devnull}
        request |= {"stdout": str(stdout), "stderr": str(stderr)}
        with contextlib.suppress(ConnectionError):  # the reader fails `started` when it is gone
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            await proc.stdin.drain()
        try:
            return await asyncio.shield(started), exited
        except asyncio.CancelledError:
            started.add_done_callback(_kill_started)
            raise

    async def close(self) -> None:
        """EOF on its stdin ends it (killing what is left of its children's groups first)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await _close(proc)
        if self._reader is not None:
            await asyncio.wait([self._reader])

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Route replies to their futures; once it ends (or is cancelled), fail the futures left."""
        assert proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                reply = json.loads(line)
                key = reply["id"]
                if "pid" in reply:
                    self._started.pop(key).set_result(reply["pid"])
                elif "error" in reply:
                    self._exits.pop(key)
                    self._started.pop(key).set_exception(OSError(reply["error"]))
                else:
                    self._exits.pop(key).set_result(reply["exit"])
            self.ended = _ended(await proc.wait())
        finally:
            lost = PreloadError(self.ended or "preload process abandoned")
            for future in [*self._started.values(), *self._exits.values()]:
                if not future.done():
                    future.set_exception(lost)
            self._started.clear()
            self._exits.clear()


def _ended(code: int) -> str:
    how = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
    return f"preload process {how}"


def _kill_started(started: "asyncio.Future[int]") -> None:
    if started.exception() is None:
        _killpg(started.result(), signal.SIGKILL)


async def _close(proc: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def preload_refusal(argv: list[str], env: dict[str, str], cwd: Path) -> str | None:
    """Why argv cannot be forked from a preload process, or None: it must be this interpreter (the
    same file in the same environment, as exec would find it on env's PATH) running a script or a
    module, and env must not change what an interpreter reads only at its start."""
    name = argv[0]
    exe = str(cwd / name) if os.sep in name else shutil.which(name, path=env.get("PATH", os.defpath))
    if exe is None or not _same_interpreter(exe):
        return f"{name} is not this interpreter ({sys.executable})"
    rest = argv[1:]
    if not ((rest[:1] == ["-m"] and len(rest) > 1) or (rest and not rest[0].startswith("-"))):
        return "the command is not `python SCRIPT ...` or `python -m MODULE ...`"
    changed = sorted(k for k, v in env.items() if k.startswith("PYTHON") and v != os.environ.get(k))
    if changed:
        return f"the harness's env sets {', '.join(changed)}, read by an interpreter only at its start"
    return None


def _same_interpreter(exe: str) -> bool:
    """Same file and same folder: a venv's python is a link to the base interpreter, but finds its
    packages through the folder it was started from."""
    here = sys.executable
    try:
        same_file = os.path.samefile(exe, here)
    except OSError:
        return False
    return same_file and os.path.realpath(os.path.dirname(exe)) == os.path.realpath(os.path.dirname(here))


async def _poll_until(done: Callable[[], bool], limit_s: float, every_s: float = 0.02) -> bool:
    """Whether `done()` came true within `limit_s`; for states nothing signals, like a process
    group's last member dying after its leader was reaped."""
    deadline = time.monotonic() + limit_s
    for _ in range(math.ceil(limit_s / every_s) + 1):
        if done():
            return True
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(every_s)
    return done()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: orphans that were killed
    wait for whoever adopted them to reap them, which may never happen in a container."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _absolute(path: Path | str) -> Path:
    """`path` made absolute against the current directory and normalised (no `..`), symlinks kept."""
    return Path(os.path.abspath(path))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _tail(path: Path, size: int = STDERR_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _read_result(path: Path, who: str) -> tuple[float, dict[str, Any]]:
    """(reward, the other keys) of a result file, or `_Failed` saying what is wrong with it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _NoReward(f"{who}result file missing") from None
    except OSError as exc:
        raise _Failed(f"{who}result file unreadable: {exc}") from None
    if size > MAX_RESULT_BYTES:
        raise _Failed(f"{who}result file is larger than {MAX_RESULT_BYTES} bytes ({size})")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise _Failed(f"{who}result file unreadable: {exc}") from None
    if not raw.strip():
        raise _NoReward(f"{who}result file is empty")
    try:
        return parse_result(raw, who)
    except NoReward as exc:
        raise _NoReward(str(exc), exc.rest) from None
    except ValueError as exc:
        raise _Failed(str(exc)) from None
