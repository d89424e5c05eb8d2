"""A real PostgreSQL 15 server for the tests that claim PostgreSQL: `initdb` into a temporary folder,
`pg_ctl start` on 127.0.0.1 at a free port, one database per test, stopped when the session ends.

Test modules import the fixtures (`postgres_fixture`, `postgres_url_fixture`: the fixtures `postgres`
and `postgres_url`) by name, as gwhelpers' `gateway` fixture is imported. One server serves the whole
session, however many modules import them: the server lives in this module, and each module's copy of
the session fixture only finds it or starts it; the first teardown at the session's end stops it.

Postgres refuses to run as root: as root, its commands run as the `postgres` OS user, in a folder
handed to that user. Without the server's binaries the tests that need one skip, saying what to install.
Durability is switched off (fsync, full page writes): a crashed test server is thrown away anyway.
"""

import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from testsupport import free_port

# Debian's layout (apt-get install postgresql); INHARNESS_PG_BIN points elsewhere.
_BIN_DIRS = [os.environ.get("INHARNESS_PG_BIN", ""), "/usr/lib/postgresql/15/bin"]
_MISSING = (
    "these tests start a real PostgreSQL 15 server and need its initdb and pg_ctl "
    "(apt-get install postgresql, or set INHARNESS_PG_BIN to their folder)"
)


def postgres_bin_dir() -> Path | None:
    for d in _BIN_DIRS:
        if d and (Path(d) / "initdb").is_file() and (Path(d) / "pg_ctl").is_file():
            return Path(d)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


class PostgresServer:
    """One postgres cluster in `root` listening on 127.0.0.1:`port`, superuser `postgres`, trust auth."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir, self.root, self.port = bin_dir, root, port
        self._user = "postgres" if os.geteuid() == 0 else None
        self._names = itertools.count(1)

    @classmethod
    def start(cls, bin_dir: Path) -> "PostgresServer":
        root = Path(tempfile.mkdtemp(prefix="inharness-pg-"))
        server = cls(bin_dir, root, free_port())
        if server._user is not None:
            shutil.chown(root, server._user, server._user)
        server._run("initdb", "-D", str(server.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        options = (
            f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off -c max_connections=300"
        )
        log = str(root / "postgres.log")
        server._run("pg_ctl", "-D", str(server.data), "-l", log, "-o", options, "-w", "-t", "60", "start")
        return server

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database, its URL: each test gets its own, so tests stay independent."""
        name = f"t{os.getpid()}_{next(self._names)}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def stop(self) -> None:
        if self.data.is_dir():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [str(self.bin_dir / tool), *args],
            user=self._user,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            log = self.root / "postgres.log"
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}\n{tail}")


_server: PostgresServer | None = None


@pytest.fixture(scope="session", name="postgres")
def postgres_fixture() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (started on first use); skips the test where none can run."""
    global _server
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(_MISSING)
    if _server is None:
        _server = PostgresServer.start(bin_dir)
    yield _server
    if _server is not None:
        _server.stop()
        _server = None


@pytest.fixture(name="postgres_url")
def postgres_url_fixture(postgres: PostgresServer) -> str:
    """The URL of a fresh database of its own for this test."""
    return postgres.create_database()
