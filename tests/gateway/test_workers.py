"""Several gateway processes on one PostgreSQL store act as one gateway: a serving pause, a model-version
switch and the progress board sent to one process reach every other (through the store's `serving`,
`model_versions` and `progress` rows), and `inharness gateway --workers N` runs N processes on one port.
Real gateways, engine and PostgreSQL on 127.0.0.1."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ADMIN
from gwhelpers import FIRST_TURN, admin, calls_of, harness_client, new_attempt
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from testsupport import Server, eventually, free_port

from inharness.gateway.store import Store


def _gateway(model: Path, engine: Server, log_dir: Path, store: str, *extra: str) -> Server:
    port = free_port()
    args = ["gateway", "--model", str(model), "--engine", engine.url, "--port", str(port), *extra]
    argv = [sys.executable, "-m", "inharness.cli", *args, f"--admin-token={ADMIN}"]
    env = {"INHARNESS_GATEWAY_STORE": store}
    return Server(argv, port=port, log=log_dir / f"gateway-workers-{port}.log", health="/healthz", env=env)


@pytest.fixture(scope="module")
def pair(engine: Server, tool_model: Path, log_dir: Path, postgres: Any) -> Iterator[tuple[Server, Server]]:
    """Two gateway processes, each on its own port, on one new database."""
    url = postgres.create_database()
    gateways = (_gateway(tool_model, engine, log_dir, url), _gateway(tool_model, engine, log_dir, url))
    for gw in gateways:
        gw.spawn()
    try:
        for gw in gateways:
            gw.wait_healthy()
        yield gateways
    finally:
        for gw in gateways:
            gw.stop()


def _ask(gw: Server, token: str, out: list[Any]) -> None:
    client = harness_client(gw, token)
    out.append(client.chat.completions.create(model="m", messages=FIRST_TURN, max_tokens=4))


def test_a_pause_sent_to_one_process_holds_calls_on_the_other_until_a_resume_sent_anywhere(
    pair: tuple[Server, Server],
) -> None:
    a, b = pair
    attempt = new_attempt(a)
    with admin(a) as ca, admin(b) as cb:
        paused = ca.post("/api/v1/serving/pause", json={"hold_seconds": 120, "drain_seconds": 10})
        assert paused.status_code == 200 and paused.json()["paused"]
        # The pause answered only once b had applied it: b holds from now on.
        assert cb.get("/api/v1/serving").json()["paused"]

        answered: list[Any] = []
        caller = threading.Thread(target=_ask, args=(b, attempt["token"], answered))
        caller.start()
        try:
            held_b = lambda: cb.get("/api/v1/serving").json()["held"] == 1  # noqa: E731
            held_a = lambda: ca.get("/api/v1/serving").json()["held"] == 1  # noqa: E731
            asyncio.run(eventually(held_b, "b holds the call"))
            # a's view sums b's held call (b reports it through the store).
            asyncio.run(eventually(held_a, "a counts b's call"))
            assert caller.is_alive() and not answered
        finally:
            resumed = cb.post("/api/v1/serving/resume")  # resumed through the other process
            caller.join(timeout=60)
        assert resumed.status_code == 200 and not resumed.json()["paused"]
        assert len(answered) == 1 and answered[0].choices[0].finish_reason in ("stop", "length")
        asyncio.run(eventually(lambda: not ca.get("/api/v1/serving").json()["paused"], "a resumed"))
        assert [c["attempt_id"] for c in calls_of(a, attempt["id"])] == [attempt["id"]]


def test_a_version_activated_through_one_process_serves_calls_through_the_other(
    pair: tuple[Server, Server], engine: Server
) -> None:
    a, b = pair
    attempt = new_attempt(a)
    with admin(a) as ca:
        r = ca.post("/api/v1/models/versions", json={"version": 5, "engines": [engine.url], "activate": True})
        assert r.status_code == 200 and r.json()["active"] == 5

    def served_by_5() -> bool:
        _ask(b, attempt["token"], [])
        return calls_of(a, attempt["id"])[-1]["model_version"] == 5

    asyncio.run(eventually(served_by_5, "a call through b served by version 5"))


def test_progress_reported_to_one_process_is_read_from_the_other(pair: tuple[Server, Server]) -> None:
    a, b = pair
    with admin(a) as ca, admin(b) as cb:
        for step, reward in [(1, 0.25), (2, 0.5)]:
            report = {"step": step, "total_steps": 4, "reward_mean": reward}
            assert ca.post("/api/v1/progress", json=report).status_code == 200
        seen = cb.get("/api/v1/progress").json()
    assert seen["reported"] and seen["step"] == 2 and seen["reward_history"] == [0.25, 0.5]


def test_workers_share_one_port_apply_a_pause_and_a_dead_worker_stops_the_gateway(
    engine: Server, tool_model: Path, log_dir: Path, postgres: Any
) -> None:
    url = postgres.create_database()
    gw = _gateway(tool_model, engine, log_dir, url, "--workers", "2").start()
    try:

        async def workers() -> list[Any]:
            store = await Store.open(url)
            try:
                return await store.workers(0.0)
            finally:
                await store.close()

        async def two_workers() -> list[Any] | None:
            found = await workers()
            return found if len(found) == 2 else None

        two = asyncio.run(eventually(two_workers, "both workers report themselves"))
        pids = {w.pid for w in two}
        assert len(pids) == 2 and gw.proc is not None and gw.proc.pid not in pids
        with admin(gw) as c:
            assert c.post("/api/v1/serving/pause", json={"drain_seconds": 10}).json()["paused"]
            generations = {w.generation for w in asyncio.run(workers())}
            assert len(generations) == 1 and generations.pop() >= 1, "both workers applied the pause"
            assert not c.post("/api/v1/serving/resume").json()["paused"]

        os.kill(two[0].pid, signal.SIGKILL)
        assert gw.proc.wait(timeout=60) == 1, "a dead worker stops the whole gateway"
    finally:
        gw.stop()


def test_workers_above_one_are_refused_on_sqlite(tool_model: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "inharness.cli", "gateway", "--model", str(tool_model), "--workers", "2"],
        env={**os.environ, "INHARNESS_GATEWAY_STORE": f"sqlite:///{tmp_path}/gw.db"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--workers above 1 needs a PostgreSQL store" in out.stderr, out.stderr
