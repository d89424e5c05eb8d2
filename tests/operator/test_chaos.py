"""Chaos: nothing lost, nothing counted twice while the gateway, the engine and harnesses are killed.

A real gateway (SQLite store) and engine under `inharness run`'s Supervisor, the local rollout
controller with 50 harness processes at once in the middle of multi-turn conversations, and an
export reader that resumes from its cursor as the trainer does. For a bounded time, every couple of
seconds: SIGKILL random harnesses, and in turn the gateway or the engine (the Supervisor restarts
them on their ports). Afterwards, from the store alone:
- every answer a harness received is recorded exactly once;
- no attempt is completed twice (one settlement per attempt, the controller's count = the store's);
- every rollout ended succeeded or failed with a reason, within its retry budget, and only a harness's
  own death was charged to it (an outage of the gateway or engine releases the attempt; a finished
  attempt's completion waits out a gateway restart rather than losing its result to the lease);
- the export stream gave each finished rollout once, across the restarts.
The figures are printed (`pytest -s`)."""

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from conftest import ADMIN
from test_local_rollouts import HARNESSES, MARK, ProcessWatch
from testsupport import Server, free_port

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ClaimedAttempt, RolloutOut
from inharness.operator.rollouts import Outcome
from inharness.operator.rollouts.local import LocalRolloutController
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec
from inharness.supervisor import Supervisor

ROLLOUTS = 150
PARALLEL = 50
TURNS = 4
MAX_ATTEMPTS = 4
CHAOS_ROUNDS = 10
ROUND_SECONDS = 2.5


async def read_export(client: GatewayClient, seen: list[str], want: int) -> int:
    """Follow the export stream from its cursor, through gateway restarts, until it gave `want`
    rollouts; returns how many times a read broke off."""
    cursor, breaks = 0, 0
    while True:
        try:
            async for line in client.export(after=cursor):
                seen.append(line.rollout.id)
                cursor = line.cursor
        except Exception:  # the gateway is down or went down mid-stream: resume from the cursor
            breaks += 1
        if len(set(seen)) >= want:
            return breaks
        await asyncio.sleep(0.2)


async def all_final(client: GatewayClient, ids: list[str], supervisor: Supervisor) -> list[RolloutOut]:
    """The rollouts once all are final; fails at once if the Supervisor gave up on a child, and
    after 240 s with the statuses it last saw."""
    statuses: Counter[str] = Counter()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(240):
            while supervisor.fatal is None:
                with contextlib.suppress(Exception):
                    outs = [await client.get_rollout(i) for i in ids]
                    statuses = Counter(o.status for o in outs)
                    if statuses.keys() <= {"succeeded", "failed"}:
                        return outs
                await asyncio.sleep(0.5)
    assert supervisor.fatal is None, supervisor.fatal
    raise AssertionError(f"rollouts not final within 240 s: {dict(statuses)}")


async def healthy(server: Server) -> bool:
    """Up and answering: a child the Supervisor is still restarting is not killed again, as the
    Supervisor would rightly give up on one that dies while it starts."""
    async with httpx.AsyncClient(timeout=2) as http:
        try:
            return server.alive and (await http.get(server.url + server.health)).status_code == 200
        except httpx.HTTPError:
            return False


async def test_kills_lose_nothing_and_count_nothing_twice(
    tiny_model: Path, tmp_path: Path, log_dir: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"\nchaos seed {seed} (CHAOS_SEED={seed} repeats the kill schedule)")
    answers = tmp_path / "answers"
    answers.mkdir()
    mark = f"chaos-{seed}-{time.time_ns()}"

    db, ports = tmp_path / "gateway.db", {"engine": free_port(), "gateway": free_port()}
    engine_url = f"http://127.0.0.1:{ports['engine']}"
    argv = {
        "engine": ["engine", "--model", str(tiny_model)],
        "gateway": ["gateway", "--model", str(tiny_model), "--store", f"sqlite:///{db}"],
    }
    extra = {"engine": [], "gateway": ["--engine", engine_url, f"--admin-token={ADMIN}"]}
    health = {"engine": "/health", "gateway": "/healthz"}
    procs: dict[str, Server] = {}

    def server(name: str) -> Server:
        """A fresh process for `name` on its port: what the Supervisor restarts."""
        port = ports[name]
        procs[name] = Server.inharness(
            [*argv[name], "--port", str(port), *extra[name]],
            port=port,
            log=log_dir / f"chaos-{name}-{port}.log",
            health=health[name],
        )
        return procs[name]

    said: list[str] = []
    supervisor = Supervisor(said.append, max_restarts=CHAOS_ROUNDS)
    for name in ("engine", "gateway"):
        proc = server(name).spawn()
        await asyncio.to_thread(proc.wait_healthy)
        supervisor.add(name, proc, lambda name=name: server(name))

    settled: list[tuple[ClaimedAttempt, Outcome]] = []
    harness = HarnessSpecSpec.model_validate(
        {
            "command": [sys.executable, str(HARNESSES / "chatty.py")],
            "env": [{"name": MARK, "value": mark}, {"name": "CHAOS_ANSWERS", "value": str(answers)}],
            "timeoutSeconds": 60,
        }
    )
    pool = RolloutPoolSpec.model_validate(
        {
            "harnessRef": {"name": "chatty"},
            "parallelism": PARALLEL,
            "maxAttemptsPerRollout": MAX_ATTEMPTS,
            "leaseSeconds": 30,
            "heartbeatSeconds": 2,
        }
    )
    gw_url = procs["gateway"].url
    stop = asyncio.Event()
    kills: Counter[str] = Counter()
    async with GatewayClient(gw_url, ADMIN) as client:
        tasks = [{"question": f"What is {i} + {i}?", "turns": TURNS} for i in range(ROLLOUTS)]
        ids = [r.id for r in await client.create_rollouts(tasks, pool="chaos", max_attempts=MAX_ATTEMPTS)]
        ctrl = LocalRolloutController(
            client,
            gw_url,
            "chaos",
            pool,
            harness,
            base_dir=HARNESSES,
            work_dir=tmp_path / "work",
            log=said.append,
            on_finish=lambda a, o: settled.append((a, o)),
            kill_grace_seconds=0.5,
            outage=supervisor.outage_since,
        )
        exported: list[str] = []
        watching = asyncio.create_task(supervisor.watch(stop))
        running = asyncio.create_task(ctrl.run(stop))
        reading = asyncio.create_task(read_export(client, exported, ROLLOUTS))
        try:
            watch = ProcessWatch(mark)  # only its /proc scan: which harness groups are alive
            for n in range(CHAOS_ROUNDS):
                await asyncio.sleep(ROUND_SECONDS)
                groups = sorted(set(watch.live().values()))
                for pgid in rng.sample(groups, min(3, len(groups))):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                        kills["harness"] += 1
                victim = ("gateway", "engine")[n % 2]
                if (n < 2 or rng.random() < 0.75) and await healthy(procs[victim]):
                    procs[victim].kill9()
                    kills[victim] += 1
            outs = await all_final(client, ids, supervisor)
            breaks = await asyncio.wait_for(reading, 60)
            attempts = [a for o in outs for a in o.attempts]
            calls = {a.id: await client.calls(a.id, bodies=False) for a in attempts}
        finally:
            reading.cancel()
            stop.set()
            await asyncio.wait_for(running, 60)
            await asyncio.wait_for(watching, 10)
            supervisor.stop_all()

    answered = [
        (p.stem, json.loads(line)["id"])
        for p in answers.glob("*.jsonl")
        for line in p.read_text().splitlines()
    ]
    recorded = Counter(
        (c.attempt_id, c.request_id) for cs in calls.values() for c in cs if c.choice_index == 0
    )
    twice = [k for k, n in recorded.items() if n > 1]
    unrecorded = [k for k in answered if recorded[k] != 1]
    by_attempt = Counter(a.id for a, _ in settled)
    print(
        f"killed {dict(kills)}; export breaks {breaks}; rollouts {Counter(o.status for o in outs)}; "
        f"attempts {Counter(a.status for a in attempts)}, failed by reason "
        f"{Counter((a.failure_reason or '')[:40] for a in attempts if a.status == 'failed')}; "
        f"calls answered {len(answered)}, "
        f"recorded {sum(recorded.values())}; settled by the controller {len(settled)}; "
        f"rollouts lost {ROLLOUTS - len(outs)}"
    )
    print("\n".join(line for line in said if "restarted in" in line))

    assert kills["gateway"] and kills["engine"] and kills["harness"], f"too few kills: {kills}"
    assert not twice, f"calls recorded more than once: {twice[:5]}"
    assert not unrecorded, f"answers a harness received that the store lacks: {unrecorded[:5]}"
    assert [k for k, n in by_attempt.items() if n > 1] == [], "an attempt settled twice"
    store_succeeded = sum(a.status == "succeeded" for a in attempts)
    assert ctrl.succeeded == store_succeeded, (ctrl.succeeded, store_succeeded)
    assert sorted(exported) == sorted(ids), "the export gave a rollout twice, or missed one"
    charged_for = Counter(a.failure_reason for a in attempts if a.status == "failed")
    assert charged_for.keys() <= {"killed by signal SIGKILL"}, (
        f"an outage of the gateway or engine was charged to a rollout: {charged_for}"
    )
    for o in outs:
        charged = [a for a in o.attempts if a.status != "released"]
        assert len(charged) <= MAX_ATTEMPTS, (o.id, [a.status for a in o.attempts])
        if o.status == "succeeded":
            assert [a.status for a in o.attempts].count("succeeded") == 1, o.attempts
        else:
            assert len(charged) == MAX_ATTEMPTS and all(a.failure_reason for a in charged), o.attempts
