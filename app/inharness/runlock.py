"""One run at a time in a run directory: an exclusive `flock` on `ROOT/.lock`.

Why flock (not a pid file checked for liveness): the kernel drops it with the last open fd, so a
SIGKILLed run frees its directory without cleanup, and a pid file's pid can be reused. Why the engine
and gateway inherit the fd (`ServerProcess(pass_fds=(lock.fd,))`): the lock then stays held until the
run *and* its servers are gone, so `--resume` cannot start a second gateway on the same SQLite store
while the old one is still dying. The pid written into the file is for messages only.

The lock belongs to the open file description, not to a thread or a pid: taking it in a worker thread is
fine, and every process holding a copy of the fd holds the lock.
"""

import fcntl
import os
import time
from pathlib import Path
from types import TracebackType

POLL_SECONDS = 0.1


class RunDirBusy(RuntimeError):
    """Another process (an `inharness run`, or a server one started) holds the directory's lock."""

    def __init__(self, root: Path, pid: int | None) -> None:
        self.root, self.pid = root, pid
        if pid is None:
            who = "pid unknown"
        elif _exists(pid):
            who = f"pid {pid}"
        else:
            who = f"pid {pid}, which has exited, but a server it started still runs"
        super().__init__(f"{root} is in use by another inharness run ({who}); stop it first")


class RunLock:
    """`acquire` or `with RunLock(root):`; `fd` is what children inherit to share the lock."""

    def __init__(self, root: Path, *, wait_seconds: float = 10.0) -> None:
        self.root = root
        self.path = root / ".lock"
        self.wait_seconds = wait_seconds
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"the lock on {self.root} is not held")
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait_seconds: float | None = None) -> "RunLock":
        """Take the lock, polling for up to `wait_seconds` (default: the constructor's) while another
        holds it: the servers of a run killed a moment ago take a moment to die. Raises `RunDirBusy`."""
        if self._fd is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        # Not O_TRUNC: the holder's pid must survive our open, for the message.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + (self.wait_seconds if wait_seconds is None else wait_seconds)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise RunDirBusy(self.root, _read_pid(fd)) from None
                    time.sleep(POLL_SECONDS)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Close our fd. Deliberately not LOCK_UN, which would unlock the shared open file description
        for the servers that inherited it too: the lock goes when the last copy of the fd closes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
