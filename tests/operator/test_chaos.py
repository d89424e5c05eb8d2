"""Chaos: nothing lost, nothing counted twice while gateways, the engine and harnesses are killed.

A real engine and gateway under `inharness run`'s Supervisor, the local rollout controller with 50
harness processes at once in the middle of multi-turn conversations, and an export reader that resumes
from its cursor as the trainer does. Two setups: one gateway on SQLite, and two gateway replicas
(separate processes and ports) on one PostgreSQL database, each harness talking to one of them, the
controller to the first and the export reader to the second. For a bounded time, every couple of
seconds: SIGKILL random harnesses, and in turn a gateway (on PostgreSQL one replica, while the other
serves) or the engine; the Supervisor restarts them on their ports. Afterwards, from the store alone:
- every answer a harness received is recorded exactly once;
- no attempt is completed twice (one settlement per attempt, the controller's count = the store's);
- every rollout ended succeeded or failed with a reason, within its retry budget, and only a harness's
  own death was charged to it (an outage of a gateway or the engine releases the attempt; a finished
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from conftest import ADMIN
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from test_local_rollouts import HARNESSES, MARK, ProcessWatch
from testsupport import Server, free_port

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import CallOut, ClaimedAttempt, RolloutOut
from inharness.operator.rollouts import Outcome
from inharness.operator.rollouts.local import LocalRolloutController
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec
from inharness.supervisor import Supervisor

PARALLEL = 50
TURNS = 4
MAX_ATTEMPTS = 4
ROUND_SECONDS = 2.5
SIGKILLED = "killed by signal SIGKILL"


@dataclass(frozen=True)
class Setup:
    """One chaos run's shape: the store, the gateway replicas on it, how long and how much."""

    store: str
    gateways: tuple[str, ...]
    rollouts: int
    rounds: int

    @property
    def victims(self) -> tuple[str, ...]:
        """Killed in turn, one per round: each gateway, the engine between them."""
        return tuple(v for gw in self.gateways for v in (gw, "engine"))


@dataclass
class Run:
    """What a chaos run left behind, read back from the store once every rollout was final."""

    setup: Setup
    ids: list[str]
    answers: Path  # what the harnesses received: `<attempt id>.jsonl`, a line per answer
    outs: list[RolloutOut] = field(default_factory=list)
    calls: dict[str, list[CallOut]] = field(default_factory=dict)
    settled: list[tuple[ClaimedAttempt, Outcome]] = field(default_factory=list)
    controller_succeeded: int = 0
    settled_in_chaos: int = 0  # attempts settled by the end of the kills
    exported: list[str] = field(default_factory=list)
    export_breaks: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    said: list[str] = field(default_factory=list)
    outages: list[tuple[str, float, float | None]] = field(default_factory=list)  # what, from, to
    seconds: dict[str, float] = field(default_factory=dict)


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


async def healthy(server: Server, supervisor: Supervisor, name: str) -> bool:
    """Up, answering, and restarted as far as the Supervisor knows: a child it is still restarting is
    not killed again (it answers before the Supervisor's own check sees it up, and the Supervisor
    rightly gives up on one that dies while it starts)."""
    if any(o.ended is None and o.what.split()[0] == name for o in supervisor.outages):
        return False
    async with httpx.AsyncClient(timeout=2) as http:
        try:
            return server.alive and (await http.get(server.url + server.health)).status_code == 200
        except httpx.HTTPError:
            return False


async def all_healthy(
    procs: dict[str, Server], supervisor: Supervisor, names: list[str], within: float
) -> bool:
    """Whether the children `names` are all up and answering, waiting up to `within` s for those
    the Supervisor is still restarting."""
    deadline = time.monotonic() + within
    while not all([await healthy(procs[n], supervisor, n) for n in names]):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.25)
    return True


async def start_children(
    setup: Setup, model: Path, log_dir: Path, supervisor: Supervisor
) -> dict[str, Server]:
    """The engine and the gateway replicas, each a Supervisor child restarted on its own port; the
    returned map always holds each one's current process."""
    ports = {name: free_port() for name in ("engine", *setup.gateways)}
    engine_url = f"http://127.0.0.1:{ports['engine']}"
    gateway = ["gateway", "--model", str(model), "--store", setup.store, "--engine", engine_url]
    procs: dict[str, Server] = {}

    def server(name: str) -> Server:
        """A fresh process for `name` on its port: what the Supervisor restarts."""
        port = ports[name]
        if name == "engine":
            argv, health = ["engine", "--model", str(model)], "/health"
        else:
            argv, health = [*gateway, f"--admin-token={ADMIN}"], "/healthz"
        procs[name] = Server.inharness(
            [*argv, "--port", str(port)], port=port, log=log_dir / f"chaos-{name}-{port}.log", health=health
        )
        return procs[name]

    for name in ("engine", *setup.gateways):  # the engine first: a gateway checks it on start
        proc = server(name).spawn()
        await asyncio.to_thread(proc.wait_healthy)
        supervisor.add(name, proc, lambda name=name: server(name))
    return procs


async def chaos(setup: Setup, model: Path, tmp_path: Path, log_dir: Path) -> Run:
    """Run `setup.rollouts` rollouts through `setup.rounds` rounds of kills, then read back what the
    store holds."""
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"\nchaos seed {seed} (CHAOS_SEED={seed} repeats the kill schedule)")
    mark = f"chaos-{seed}-{time.time_ns()}"
    answers = tmp_path / "answers"
    answers.mkdir()
    began = time.monotonic()
    said: list[str] = []
    supervisor = Supervisor(said.append, max_restarts=setup.rounds)
    procs = await start_children(setup, model, log_dir, supervisor)
    harness = HarnessSpecSpec.model_validate(
        {
            "command": [sys.executable, str(HARNESSES / "chatty.py")],
            "env": [
                {"name": MARK, "value": mark},
                {"name": "CHAOS_ANSWERS", "value": str(answers)},
                {"name": "CHAOS_GATEWAYS", "value": " ".join(procs[g].url for g in setup.gateways)},
            ],
            "timeoutSeconds": 120,  # 50 harnesses on one CPU engine: room for a loaded machine
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
    first, last = procs[setup.gateways[0]].url, procs[setup.gateways[-1]].url
    stop = asyncio.Event()
    async with GatewayClient(first, ADMIN) as client, GatewayClient(last, ADMIN) as reader:
        tasks = [{"question": f"What is {i} + {i}?", "turns": TURNS} for i in range(setup.rollouts)]
        created = await client.create_rollouts(tasks, pool="chaos", max_attempts=MAX_ATTEMPTS)
        run = Run(setup, [r.id for r in created], answers, said=said)
        ctrl = LocalRolloutController(
            client,
            first,
            "chaos",
            pool,
            harness,
            base_dir=HARNESSES,
            work_dir=tmp_path / "work",
            log=said.append,
            on_finish=lambda a, o: run.settled.append((a, o)),
            kill_grace_seconds=0.5,
            outage=supervisor.outage_since,
        )
        watching = asyncio.create_task(supervisor.watch(stop))
        running = asyncio.create_task(ctrl.run(stop))
        reading = asyncio.create_task(read_export(reader, run.exported, setup.rollouts))
        try:
            watch = ProcessWatch(mark)  # only its /proc scan: which harness groups are alive
            run.seconds["start"] = time.monotonic() - began
            for n in range(setup.rounds):
                await asyncio.sleep(ROUND_SECONDS)
                groups = sorted(set(watch.live().values()))
                for pgid in rng.sample(groups, min(3, len(groups))):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
                        run.kills["harness"] += 1
                victim = setup.victims[n % len(setup.victims)]
                spared = [g for g in setup.gateways if g != victim and victim != "engine"]
                if (
                    (n < len(setup.victims) or rng.random() < 0.75)
                    and await healthy(procs[victim], supervisor, victim)
                    and await all_healthy(procs, supervisor, spared, within=30)  # one replica down at a time
                ):
                    procs[victim].kill9()
                    run.kills[victim] += 1
            run.seconds["chaos"] = time.monotonic() - began
            run.settled_in_chaos = len(run.settled)
            run.outs = await all_final(client, run.ids, supervisor)
            run.seconds["final"] = time.monotonic() - began
            run.export_breaks = await asyncio.wait_for(reading, 60)
            attempts = [a for o in run.outs for a in o.attempts]
            run.calls = {a.id: await client.calls(a.id, bodies=False) for a in attempts}
        finally:
            reading.cancel()
            stop.set()
            await asyncio.wait_for(running, 60)
            await asyncio.wait_for(watching, 10)
            supervisor.stop_all()
    run.controller_succeeded = ctrl.succeeded
    run.outages = [(o.what, o.started, o.ended) for o in supervisor.outages]
    return run


def check(run: Run) -> None:
    """Print the run's figures, then hold its answers and settlements against the store."""
    setup, outs = run.setup, run.outs
    answered = [
        (p.stem, json.loads(line)) for p in run.answers.glob("*.jsonl") for line in p.read_text().splitlines()
    ]
    attempts = [a for o in outs for a in o.attempts]
    recorded = Counter(
        (c.attempt_id, c.request_id) for cs in run.calls.values() for c in cs if c.choice_index == 0
    )
    twice = [k for k, n in recorded.items() if n > 1]
    unrecorded = [(a, line["id"]) for a, line in answered if recorded[a, line["id"]] != 1]
    by_attempt = Counter(a.id for a, _ in run.settled)
    via = Counter(line["via"] for _, line in answered)
    print(
        f"{setup.store.partition(':')[0]}, gateways {list(setup.gateways)}: killed {dict(run.kills)}; "
        f"export breaks {run.export_breaks}; rollouts {Counter(o.status for o in outs)}; "
        f"attempts {Counter(a.status for a in attempts)}, failed by reason "
        f"{Counter((a.failure_reason or '')[:40] for a in attempts if a.status == 'failed')}; "
        f"calls answered {len(answered)} (by gateway port {dict(via)}), "
        f"recorded {sum(recorded.values())}; settled by the controller {len(run.settled)} "
        f"({run.settled_in_chaos} by the end of the kills); "
        f"rollouts lost {setup.rollouts - len(outs)}; seconds "
        + ", ".join(f"{k} {v:.0f}" for k, v in run.seconds.items())
    )
    print("\n".join(line for line in run.said if "restarted in" in line))

    killed = [v for v in ("harness", *setup.victims) if not run.kills[v]]
    assert not killed, f"too few kills: {run.kills}"
    assert len(via) == len(setup.gateways), f"harnesses did not use every gateway: {via}"
    assert not twice, f"calls recorded more than once: {twice[:5]}"
    assert not unrecorded, f"answers a harness received that the store lacks: {unrecorded[:5]}"
    assert [k for k, n in by_attempt.items() if n > 1] == [], "an attempt settled twice"
    store_succeeded = sum(a.status == "succeeded" for a in attempts)
    assert run.controller_succeeded == store_succeeded, (run.controller_succeeded, store_succeeded)
    assert sorted(run.exported) == sorted(run.ids), "the export gave a rollout twice, or missed one"
    charged_for = Counter(a.failure_reason for a in attempts if a.status == "failed")
    odd = [
        (a.failure_reason, a.claimed_at, a.finished_at)
        for a in attempts
        if a.status == "failed" and a.failure_reason != SIGKILLED
    ]
    assert charged_for.keys() <= {SIGKILLED}, (
        f"an outage of a gateway or the engine was charged to a rollout: {charged_for}; "
        f"those attempts (reason, claimed, finished) {odd[:5]}, the outages {run.outages}"
    )
    for o in outs:
        charged = [a for a in o.attempts if a.status != "released"]
        assert len(charged) <= MAX_ATTEMPTS, (o.id, [a.status for a in o.attempts])
        if o.status == "succeeded":
            assert [a.status for a in o.attempts].count("succeeded") == 1, o.attempts
        else:
            assert len(charged) == MAX_ATTEMPTS and all(a.failure_reason for a in charged), o.attempts


async def test_kills_lose_nothing_and_count_nothing_twice(
    tiny_model: Path, tmp_path: Path, log_dir: Path
) -> None:
    setup = Setup(f"sqlite:///{tmp_path / 'gateway.db'}", ("gateway",), rollouts=150, rounds=10)
    check(await chaos(setup, tiny_model, tmp_path, log_dir))


async def test_killing_one_of_two_postgres_replicas_loses_nothing_and_counts_nothing_twice(
    tiny_model: Path, tmp_path: Path, log_dir: Path, postgres_url: str
) -> None:
    setup = Setup(postgres_url, ("gateway-a", "gateway-b"), rollouts=60, rounds=6)
    check(await chaos(setup, tiny_model, tmp_path, log_dir))
