"""The local rollout controller against a real gateway and engine on 127.0.0.1, running real
harness subprocesses (tests/operator/harnesses/): outcomes, retries, timeouts, process-group
cleanup, parallelism, stop, and lost leases."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ADMIN
from testsupport import Server, gateway_server, start_engine

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ClaimedAttempt, RolloutOut
from inharness.operator.rollouts import Outcome
from inharness.operator.rollouts.local import LocalRolloutController, Zygote, preload_refusal
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec

HARNESSES = Path(__file__).parent / "harnesses"
PY = sys.executable
MARK = "INHARNESS_TEST_MARK"


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Server]:
    """An engine on the untrained tiny model is enough: the harnesses need answers, not good ones.
    One `import openai` up front compiles its bytecode, which would otherwise eat into the first
    harnesses' timeouts."""
    subprocess.run([PY, "-c", "import openai"], check=True, timeout=120)
    engine = start_engine(tiny_model, log_dir)
    db = tmp_path_factory.mktemp("operator-gw") / "gateway.db"
    try:
        server = gateway_server(tiny_model, [engine.url], db, log_dir, admin_token=ADMIN).start()
        yield server
        server.stop()
    finally:
        engine.stop()


class ProcessWatch:
    """Counts, from /proc, the process groups of one test's harnesses (marked through the spec's env)
    that run at once: the real number of concurrent harness runs, kills included."""

    def __init__(self, mark: str) -> None:
        self.needle = f"{MARK}={mark}".encode()
        self.max_groups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def live(self) -> dict[int, int]:
        """pid -> process group of each live (not zombie) marked process."""
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if self.needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] not in ("Z", "X"):
                out[int(entry.name)] = int(fields[2])
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.max_groups = max(self.max_groups, len(set(self.live().values())))
            self._stop.wait(0.01)

    def __enter__(self) -> "ProcessWatch":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def hung_pids(tmp: Path) -> list[dict[str, int]]:
    """The pids hang.py wrote: its own and its child's, one file per attempt."""
    return [json.loads(p.read_text()) for p in tmp.glob("at*.json")]


async def until(cond: Callable[[], bool], limit_s: float = 20.0, every_s: float = 0.05) -> None:
    for _ in range(int(limit_s / every_s)):
        if cond():
            return
        await asyncio.sleep(every_s)
    raise TimeoutError(f"not true within {limit_s}s")


def harness_spec(mark: str, tmp: Path, **spec: Any) -> HarnessSpecSpec:
    env = [{"name": MARK, "value": mark}, {"name": "TEST_PID_DIR", "value": str(tmp)}]
    return HarnessSpecSpec.model_validate(
        {"command": [PY, str(HARNESSES / "dispatch.py")], "env": env, **spec}
    )


def controller(
    gw: Server,
    client: GatewayClient,
    pool_name: str,
    pool: dict[str, Any],
    harness: HarnessSpecSpec,
    tmp: Path,
) -> tuple[LocalRolloutController, list[tuple[ClaimedAttempt, Outcome]], list[str]]:
    finished: list[tuple[ClaimedAttempt, Outcome]] = []
    logs: list[str] = []
    ctrl = LocalRolloutController(
        client,
        gw.url,
        pool_name,
        RolloutPoolSpec.model_validate({"harnessRef": {"name": "h"}, **pool}),
        harness,
        base_dir=HARNESSES,
        work_dir=tmp / "work",
        log=logs.append,
        on_finish=lambda a, o: finished.append((a, o)),
        kill_grace_seconds=0.5,
    )
    return ctrl, finished, logs


async def finished_rollouts(client: GatewayClient, ids: list[str], limit_s: float) -> list[RolloutOut]:
    async with asyncio.timeout(limit_s):
        while True:
            outs = [await client.get_rollout(i) for i in ids]
            if all(o.status in ("succeeded", "failed") for o in outs):
                return outs
            await asyncio.sleep(0.1)


async def run_batch(
    ctrl: LocalRolloutController, client: GatewayClient, ids: list[str], limit_s: float = 40
) -> list[RolloutOut]:
    stop = asyncio.Event()
    running = asyncio.create_task(ctrl.run(stop))
    try:
        return await finished_rollouts(client, ids, limit_s)
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)


async def test_batch_of_good_and_bad_harnesses(gateway: Server, tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, timeoutSeconds=5)
    tasks: list[dict[str, Any]] = [
        {"run": "good", "question": "What is 2+3?", "reward": 1.0},
        {"run": "crash"},
        {"run": "hang"},
        {"run": "bad_result", "write": "garbage"},
        {"run": "good", "question": "Name a colour.", "reward": 0.25},
        {"run": "bad_result", "write": "no_reward"},
        {"run": "bad_result", "write": "nothing"},
    ]
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts(tasks, pool="mixed", max_attempts=2)
        pool = {"parallelism": 3, "maxAttemptsPerRollout": 2}
        ctrl, finished, _ = controller(gateway, client, "mixed", pool, harness, tmp_path)
        with ProcessWatch(mark) as watch:
            outs = await run_batch(ctrl, client, [r.id for r in created])
            assert watch.live() == {}
        good_calls = [await client.calls(o.attempts[0].id) for o in (outs[0], outs[4])]

    assert 2 <= watch.max_groups <= 3
    good, crash, hang, garbage, good2, no_reward, nothing = outs
    for rollout, reward in ((good, 1.0), (good2, 0.25)):
        assert (rollout.status, rollout.reward, len(rollout.attempts)) == ("succeeded", reward, 1), (
            rollout.attempts
        )
        assert rollout.attempts[0].info["result"]["base_url"] == f"{gateway.url}/v1"
    assert all(len(calls) == 1 for calls in good_calls), (
        "each good harness's call is recorded under its attempt"
    )

    expected = {
        "exited with code 3": crash,
        "timed out after 5s": hang,
        "result file is not valid JSON: ": garbage,
        "result has no numeric 'reward'": no_reward,
        "result file missing": nothing,
    }
    for reason, rollout in expected.items():
        assert rollout.status == "failed" and len(rollout.attempts) == 2, reason
        for attempt in rollout.attempts:
            assert attempt.status == "failed" and attempt.failure_reason is not None
            assert attempt.failure_reason.startswith(reason), (reason, attempt.failure_reason)
    assert "boom: the harness fell over" in crash.attempts[0].info["stderr_tail"]
    assert crash.attempts[0].info["exit_code"] == 3

    pids = hung_pids(tmp_path)
    assert len(pids) == 2
    assert not any(alive(p["pid"]) or alive(p["child"]) for p in pids), "the hung harness's group survived"

    assert (ctrl.started, ctrl.succeeded, ctrl.failed, ctrl.running) == (12, 2, 10, 0)
    assert ctrl.failed_by_reason == {
        "exited with code 3": 2,
        "timed out after 5s": 2,
        "result file is not valid JSON": 2,
        "result has no numeric 'reward'": 2,
        "result file missing": 2,
    }
    assert len(finished) == 12
    assert {a.id for a, _ in finished} == {a.id for o in outs for a in o.attempts}


async def test_key_in_path(gateway: Server, tmp_path: Path) -> None:
    harness = harness_spec(uuid.uuid4().hex, tmp_path, model={"keyIn": "path", "modelName": "my-model"})
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts([{"run": "good", "question": "Hi"}], pool="keypath")
        ctrl, finished, _ = controller(gateway, client, "keypath", {}, harness, tmp_path)
        [out] = await run_batch(ctrl, client, [created[0].id])
        [call] = await client.calls(out.attempts[0].id)
    assert out.status == "succeeded"
    base_url = out.attempts[0].info["result"]["base_url"]
    assert base_url.startswith(f"{gateway.url}/t/ih-") and base_url.endswith("/v1")
    assert base_url == f"{gateway.url}/t/{finished[0][0].token}/v1"
    assert call.requested_model == "my-model"


async def test_grader_and_exit_code_outcomes(gateway: Server, tmp_path: Path) -> None:
    grader = {"type": "grader", "grader": {"command": [PY, "grader.py"], "timeoutSeconds": 10}}
    graded = harness_spec(uuid.uuid4().hex, tmp_path, command=[PY, "answer.py"], outcome=grader)
    by_exit = harness_spec(
        uuid.uuid4().hex, tmp_path, command=[PY, "answer.py"], outcome={"type": "exitCode"}
    )
    async with GatewayClient(gateway.url, ADMIN) as client:
        g_tasks = [
            {"answer": "42", "expected": "42"},
            {"answer": "41", "expected": "42"},
            {"answer": "42", "expected": "42", "exit": 2},
            {"grader_crash": True},
        ]
        g_rollouts = await client.create_rollouts(g_tasks, pool="graded", max_attempts=2)
        e_rollouts = await client.create_rollouts([{"exit": 0}, {"exit": 3}], pool="by-exit", max_attempts=2)
        g_ctrl, _, _ = controller(gateway, client, "graded", {"parallelism": 2}, graded, tmp_path)
        e_ctrl, _, _ = controller(gateway, client, "by-exit", {"parallelism": 2}, by_exit, tmp_path)
        g_outs, e_outs = await asyncio.gather(
            run_batch(g_ctrl, client, [r.id for r in g_rollouts]),
            run_batch(e_ctrl, client, [r.id for r in e_rollouts]),
        )

    right, wrong, bad_exit, crash = g_outs
    assert [(o.status, o.reward) for o in (right, wrong, bad_exit)] == [
        ("succeeded", 1.0),
        ("succeeded", 0.0),
        ("succeeded", 0.0),
    ]
    assert right.attempts[0].info["result"] == {"exit_code_seen": 0, "harness_note": "from the harness"}
    assert bad_exit.attempts[0].info["result"]["exit_code_seen"] == 2
    assert crash.status == "failed" and len(crash.attempts) == 2
    assert {a.failure_reason for a in crash.attempts} == {"grader exited with code 1"}
    assert "grader: cannot grade this" in crash.attempts[0].info["grader_stderr_tail"]
    assert [(o.status, o.reward, len(o.attempts)) for o in e_outs] == [
        ("succeeded", 1.0, 1),
        ("succeeded", 0.0, 1),
    ]


async def test_a_posted_reward_stands_in_only_for_a_missing_one_and_the_result_file_wins(
    gateway: Server, tmp_path: Path
) -> None:
    header = harness_spec(uuid.uuid4().hex, tmp_path)
    in_path = harness_spec(uuid.uuid4().hex, tmp_path, model={"keyIn": "path"})
    tasks: list[dict[str, Any]] = [
        {"run": "post_reward", "post": [0.25]},  # no result file: the posted reward
        {"run": "post_reward", "post": [0.25], "write": {"reward": 0.75}},  # the result file wins
        {"run": "post_reward", "post": [0.25], "write": {"steps": 3}},  # a result without a reward
        {"run": "post_reward", "post": [0.1, 0.5]},  # the latest post
        {"run": "post_reward", "post": [1.0], "exit": 3},  # a failed harness stays failed
        {"run": "post_reward"},  # nothing posted, no result file
    ]
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts(tasks, pool="posted", max_attempts=1)
        by_path = await client.create_rollouts([tasks[0]], pool="posted-path", max_attempts=1)
        ctrl, _, _ = controller(gateway, client, "posted", {"parallelism": 3}, header, tmp_path)
        p_ctrl, _, _ = controller(gateway, client, "posted-path", {}, in_path, tmp_path)
        outs, (path_out,) = await asyncio.gather(
            run_batch(ctrl, client, [r.id for r in created]), run_batch(p_ctrl, client, [by_path[0].id])
        )
    only, wins, no_reward, latest, crashed, nothing = outs
    assert [(o.status, o.reward) for o in (only, wins, no_reward, latest, path_out)] == [
        ("succeeded", 0.25),
        ("succeeded", 0.75),
        ("succeeded", 0.25),
        ("succeeded", 0.5),
        ("succeeded", 0.25),
    ]
    info = only.attempts[0].info
    assert info["reward_source"] == "posted" and info["posted"] == {"note": "posted"}
    assert "reward_source" not in wins.attempts[0].info
    assert no_reward.attempts[0].info["result"] == {"steps": 3}
    assert crashed.status == "failed" and crashed.attempts[0].failure_reason == "exited with code 3"
    assert nothing.status == "failed" and nothing.attempts[0].failure_reason == "result file missing"
    assert "_reward_missing" not in nothing.attempts[0].info


async def test_unstartable_harness_fails_with_the_os_error(gateway: Server, tmp_path: Path) -> None:
    harness = harness_spec(uuid.uuid4().hex, tmp_path, command=[str(tmp_path / "no-such-harness")])
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts([{}], pool="unstartable", max_attempts=1)
        ctrl, _, _ = controller(
            gateway, client, "unstartable", {"maxAttemptsPerRollout": 1}, harness, tmp_path
        )
        [out] = await run_batch(ctrl, client, [created[0].id])
    reason = out.attempts[0].failure_reason or ""
    assert out.status == "failed" and reason.startswith("could not start: ") and "no-such-harness" in reason


async def test_stop_mid_run_kills_every_harness_and_releases_its_attempts_uncharged(
    gateway: Server, tmp_path: Path
) -> None:
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, timeoutSeconds=60)
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts([{"run": "hang"}] * 3, pool="stopping", max_attempts=2)
        ctrl, finished, _ = controller(gateway, client, "stopping", {"parallelism": 2}, harness, tmp_path)
        stop = asyncio.Event()
        with ProcessWatch(mark) as watch:
            running = asyncio.create_task(ctrl.run(stop))
            await until(lambda: len(hung_pids(tmp_path)) == 2)
            stop.set()
            await asyncio.wait_for(running, 15)
            assert watch.live() == {}, "a harness process survived stop"
        outs = [await client.get_rollout(r.id) for r in created]

    assert watch.max_groups == 2
    pids = hung_pids(tmp_path)
    assert not any(alive(p["pid"]) or alive(p["child"]) for p in pids)
    assert (ctrl.started, ctrl.released, ctrl.failed, ctrl.running) == (2, 2, 0, 0)
    assert [(o.status, o.reason) for _, o in finished] == [("released", "stopped")] * 2
    claimed = [o for o in outs if o.attempts]
    assert len(claimed) == 2 and all(o.status == "queued" for o in outs), "stopped attempts are requeued"
    assert all(o.attempts[0].status == "released" for o in claimed), "a stop is not the harness's fault"
    assert all(o.attempts[0].failure_reason == "stopped" for o in claimed)


async def test_lost_lease_stops_the_harness_and_its_refused_completion_is_ignored(
    gateway: Server, tmp_path: Path
) -> None:
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, timeoutSeconds=30)
    pool = {"maxAttemptsPerRollout": 1, "heartbeatSeconds": 1, "leaseSeconds": 10}
    async with GatewayClient(gateway.url, ADMIN) as client:
        [created] = await client.create_rollouts([{"run": "hang"}], pool="lease-lost", max_attempts=1)
        ctrl, _, logs = controller(gateway, client, "lease-lost", pool, harness, tmp_path)
        stop = asyncio.Event()
        with ProcessWatch(mark) as watch:
            running = asyncio.create_task(ctrl.run(stop))
            await until(lambda: bool(hung_pids(tmp_path)))
            attempt = (await client.get_rollout(created.id)).attempts[0]
            # Someone else (a restarted operator, an admin) finishes the attempt meanwhile.
            await client.complete(attempt.id, "succeeded", reward=0.5)
            await until(lambda: ctrl.failed == 1)
            assert watch.live() == {}
            stop.set()
            await asyncio.wait_for(running, 15)
        out = await client.get_rollout(created.id)

    assert (out.status, out.reward, len(out.attempts)) == ("succeeded", 0.5, 1), "the first completion stands"
    assert (ctrl.failed, ctrl.unreported, dict(ctrl.failed_by_reason)) == (1, 1, {"lease lost": 1})
    assert any("lease lost" in line for line in logs)
    assert any("completion refused" in line for line in logs)


# --- spec.local.preload: harnesses forked from a preload process ------------------------------------

PRELOAD = {"local": {"preload": ["preload_marker"]}}
PER_ATTEMPT = {
    "INHARNESS_ATTEMPT_ID",
    "INHARNESS_ROLLOUT_ID",
    "INHARNESS_TASK",
    "INHARNESS_TASK_FILE",
    "INHARNESS_RESULT_FILE",
    "OPENAI_API_KEY",
}


@pytest.fixture
def marker_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where preload_marker.py notes each import; set in this process's environment, which the
    preload process inherits (the harness's own env reaches only the attempts)."""
    marks = tmp_path / "marks.txt"
    monkeypatch.setenv("PRELOAD_MARKER_FILE", str(marks))
    return marks


def importers(marker_file: Path) -> list[int]:
    """The pids that imported preload_marker, once per import."""
    return [int(pid) for pid in marker_file.read_text().split()]


def preload_processes() -> list[int]:
    """Live preload processes of this test process. Its forked harnesses show the same command line
    (and the same /proc environ) as it, but are its children, not ours."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            ours = int(stat[stat.rfind(")") + 2 :].split()[1]) == os.getpid()
            if ours and b"preload.py" in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


async def test_preloaded_harnesses_end_as_exec_ones_do(
    gateway: Server, tmp_path: Path, marker_file: Path
) -> None:
    """inproc.py runs each behaviour in the forked process itself: success, crash, a hang with a
    child past its timeout, a broken result file; the same outcomes as the exec'd batch above."""
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, command=[PY, "inproc.py"], timeoutSeconds=3)
    tasks: list[dict[str, Any]] = [
        {"run": "good", "question": "What is 2+3?", "reward": 0.5},
        {"run": "crash"},
        {"run": "hang"},
        {"run": "bad_result", "write": "garbage"},
        {"run": "probe"},
    ]
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts(tasks, pool="preload-mixed", max_attempts=1)
        pool = {"parallelism": 3, **PRELOAD}
        ctrl, _, logs = controller(gateway, client, "preload-mixed", pool, harness, tmp_path)
        with ProcessWatch(mark) as watch:
            outs = await run_batch(ctrl, client, [r.id for r in created])
            assert watch.live() == {}

    good, crash, hang, garbage, probe = outs
    assert (good.status, good.reward) == ("succeeded", 0.5)
    assert probe.attempts[0].info["result"]["seen"]["preloaded"], "the harness was not forked"
    reasons = [o.attempts[0].failure_reason for o in (crash, hang, garbage)]
    assert reasons[:2] == ["exited with code 3", "timed out after 3s"]
    assert (reasons[2] or "").startswith("result file is not valid JSON: ")
    assert crash.attempts[0].info["exit_code"] == 3
    assert "boom: the harness fell over" in crash.attempts[0].info["stderr_tail"]
    [pids] = hung_pids(tmp_path)
    assert not alive(pids["pid"]) and not alive(pids["child"]), "the hung harness's group survived"
    assert len(importers(marker_file)) == 1
    assert not any("preload" in line for line in logs), logs


async def test_preloaded_modules_are_imported_once_not_per_attempt(
    gateway: Server, tmp_path: Path, marker_file: Path
) -> None:
    harness = harness_spec(uuid.uuid4().hex, tmp_path, command=[PY, "probe.py"])
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts([{}] * 3, pool="preload-once", max_attempts=1)
        ctrl, _, _ = controller(
            gateway, client, "preload-once", {"parallelism": 2, **PRELOAD}, harness, tmp_path
        )
        outs = await run_batch(ctrl, client, [r.id for r in created])
    assert [o.status for o in outs] == ["succeeded"] * 3
    seen = [o.attempts[0].info["result"]["seen"] for o in outs]
    [importer] = importers(marker_file)
    assert {s["ppid"] for s in seen} == {importer}, "each attempt is a child of the one importer"
    assert all(s["preloaded"] for s in seen)


async def test_a_preloaded_harness_sees_what_an_execd_one_sees(
    gateway: Server, tmp_path: Path, marker_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python probe.py` as `inharness run` runs it: this interpreter's folder first on PATH."""
    monkeypatch.setenv("PATH", f"{Path(PY).parent}{os.pathsep}{os.environ['PATH']}")
    harness = harness_spec(uuid.uuid4().hex, tmp_path, command=["python", "probe.py"], args=["-v", "a b"])
    async with GatewayClient(gateway.url, ADMIN) as client:
        plain = await client.create_rollouts([{}], pool="probe-plain", max_attempts=1)
        forked = await client.create_rollouts([{}], pool="probe-forked", max_attempts=1)
        p_ctrl, _, _ = controller(gateway, client, "probe-plain", {}, harness, tmp_path / "p")
        f_ctrl, _, logs = controller(gateway, client, "probe-forked", PRELOAD, harness, tmp_path / "f")
        [p_out] = await run_batch(p_ctrl, client, [plain[0].id])
        [f_out] = await run_batch(f_ctrl, client, [forked[0].id])
    assert logs == []
    p, f = (o.attempts[0].info["result"]["seen"] for o in (p_out, f_out))
    assert (p["preloaded"], f["preloaded"]) == (False, True)
    assert p["argv"] == ["probe.py", "-v", "a b"]
    assert f["argv"] == [str(HARNESSES / "probe.py"), "-v", "a b"], "argv[0] is the absolute path"
    for key in ("cwd", "name", "file", "path0"):
        assert p[key] == f[key], key
    assert p["name"] == "__main__" and p["file"] == str(HARNESSES / "probe.py")
    for s in (p, f):
        assert s["pid"] == s["pgid"] == s["sid"], "its own session and process group"
    assert p["ppid"] == os.getpid() and f["ppid"] != os.getpid()
    drop = lambda env: {k: v for k, v in env.items() if k not in PER_ATTEMPT}  # noqa: E731
    assert drop(p["env"]) == drop(f["env"])
    assert p["env"].keys() == f["env"].keys()


async def test_a_command_preload_cannot_fork_runs_as_usual_with_one_line_saying_why(
    gateway: Server, tmp_path: Path, marker_file: Path
) -> None:
    write = 'echo \'{"reward": 0.5}\' > "$INHARNESS_RESULT_FILE"'
    harness = harness_spec(uuid.uuid4().hex, tmp_path, command=["/bin/sh", "-c", write])
    unimportable = {"local": {"preload": ["no_such_module_here"]}}
    probe = harness_spec(uuid.uuid4().hex, tmp_path, command=[PY, "probe.py"])
    async with GatewayClient(gateway.url, ADMIN) as client:
        sh = await client.create_rollouts([{}] * 2, pool="preload-sh", max_attempts=1)
        bad = await client.create_rollouts([{}] * 2, pool="preload-bad", max_attempts=1)
        sh_ctrl, _, sh_logs = controller(gateway, client, "preload-sh", PRELOAD, harness, tmp_path)
        bad_ctrl, _, bad_logs = controller(gateway, client, "preload-bad", unimportable, probe, tmp_path)
        sh_outs = await run_batch(sh_ctrl, client, [r.id for r in sh])
        bad_outs = await run_batch(bad_ctrl, client, [r.id for r in bad])
    assert [(o.status, o.reward) for o in sh_outs] == [("succeeded", 0.5)] * 2
    assert sh_logs == [
        f"pool preload-sh: spec.local.preload not used: /bin/sh is not this interpreter ({PY})"
    ]
    assert [o.status for o in bad_outs] == ["succeeded"] * 2
    assert not any(o.attempts[0].info["result"]["seen"]["preloaded"] for o in bad_outs)
    [line] = bad_logs
    assert line.startswith(
        "pool preload-bad: spec.local.preload not used: preload process: cannot import no_such_module_here: "
        "ModuleNotFoundError"
    ), line


async def test_stop_leaves_no_preload_process_nor_harness(
    gateway: Server, tmp_path: Path, marker_file: Path
) -> None:
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, command=[PY, "hang.py"], timeoutSeconds=60)
    async with GatewayClient(gateway.url, ADMIN) as client:
        await client.create_rollouts([{}] * 2, pool="preload-stop", max_attempts=1)
        ctrl, finished, _ = controller(
            gateway, client, "preload-stop", {"parallelism": 2, **PRELOAD}, harness, tmp_path
        )
        stop = asyncio.Event()
        with ProcessWatch(mark) as watch:
            running = asyncio.create_task(ctrl.run(stop))
            await until(lambda: len(hung_pids(tmp_path)) == 2)
            [zygote] = preload_processes()
            stop.set()
            await asyncio.wait_for(running, 15)
            assert watch.live() == {}, "a harness process survived stop"
    assert not alive(zygote) and preload_processes() == []
    assert not any(alive(p["pid"]) or alive(p["child"]) for p in hung_pids(tmp_path))
    assert [o.reason for _, o in finished] == ["stopped", "stopped"]


async def test_a_dead_preload_process_fails_its_attempts_and_the_next_one_restarts_it(
    gateway: Server, tmp_path: Path, marker_file: Path
) -> None:
    mark = uuid.uuid4().hex
    harness = harness_spec(mark, tmp_path, command=[PY, "inproc.py"], timeoutSeconds=60)
    async with GatewayClient(gateway.url, ADMIN) as client:
        [hung] = await client.create_rollouts([{"run": "hang"}], pool="preload-dies", max_attempts=1)
        ctrl, _, logs = controller(gateway, client, "preload-dies", PRELOAD, harness, tmp_path)
        stop = asyncio.Event()
        with ProcessWatch(mark) as watch:
            running = asyncio.create_task(ctrl.run(stop))
            await until(lambda: bool(hung_pids(tmp_path)))
            [zygote] = preload_processes()
            os.kill(zygote, signal.SIGKILL)
            [out] = await finished_rollouts(client, [hung.id], 20)
            assert watch.live() == {}, "the orphaned harness group survived"
            [probe] = await client.create_rollouts([{"run": "probe"}], pool="preload-dies", max_attempts=1)
            [after] = await finished_rollouts(client, [probe.id], 20)
            stop.set()
            await asyncio.wait_for(running, 15)
    assert out.attempts[0].failure_reason == "preload process killed by signal SIGKILL"
    assert after.status == "succeeded" and after.attempts[0].info["result"]["seen"]["preloaded"]
    assert logs == ["pool preload-dies: preload process killed by signal SIGKILL; starting a new one"]
    assert len(importers(marker_file)) == 2
    assert preload_processes() == []


# --- the preload process on its own: protocol and interpreter semantics -------------------------------

CHILD_SCRIPTS = {
    "ok.py": "import atexit, threading, time\n"
    "atexit.register(print, 'atexit ran')\n"
    "threading.Thread(target=lambda: (time.sleep(0.2), print('thread joined'))).start()\n",
    "exit_msg.py": "import sys\nsys.exit('bad thing')\n",
    "raises.py": "raise ValueError('nope')\n",
    "exit_300.py": "raise SystemExit(300)\n",
    "killed.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "signals.py": "import signal\n"
    "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "
    "signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n",
    "modx.py": "import sys\nprint(__name__, sys.argv)\n",
}


@pytest.mark.parametrize(
    ("args", "code", "out", "err"),
    [
        (["ok.py"], 0, "atexit ran", ""),
        (["ok.py"], 0, "thread joined", ""),
        (["exit_msg.py"], 1, "", "bad thing"),
        (["raises.py"], 1, "", "ValueError: nope"),
        (["exit_300.py"], 44, "", ""),
        (["killed.py"], -9, "", ""),
        (["signals.py"], 0, "True True", ""),
        (["-m", "modx", "arg"], 0, "__main__ ['{tmp}/modx.py', 'arg']", ""),
        (["missing.py"], 2, "", "can't open file '{tmp}/missing.py'"),
    ],
    ids=["atexit", "threads", "exit-message", "traceback", "exit-300", "signal", "signals", "-m", "missing"],
)
async def test_a_forked_child_exits_as_the_interpreter_would(
    tmp_path: Path, args: list[str], code: int, out: str, err: str
) -> None:
    for name, text in CHILD_SCRIPTS.items():
        (tmp_path / name).write_text(text)
    zygote = Zygote([], tmp_path, tmp_path / "preload.log")
    await zygote.start()
    try:
        stdout, stderr = tmp_path / "out.log", tmp_path / "err.log"
        _, exited = await zygote.spawn(args, dict(os.environ), tmp_path, stdout, stderr)
        assert await asyncio.wait_for(exited, 20) == code
    finally:
        await zygote.close()
    assert out.format(tmp=tmp_path) in stdout.read_text()
    assert err.format(tmp=tmp_path) in stderr.read_text()
    assert preload_processes() == []


async def test_spawn_refuses_a_missing_cwd_and_eof_ends_the_preload_process_with_its_children(
    tmp_path: Path,
) -> None:
    zygote = Zygote([], tmp_path, tmp_path / "preload.log")
    await zygote.start()
    with pytest.raises(OSError, match="No such file or directory"):
        await zygote.spawn(["x.py"], {}, tmp_path / "gone", tmp_path / "o", tmp_path / "e")
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    pid, exited = await zygote.spawn(["sleep.py"], {}, tmp_path, tmp_path / "o", tmp_path / "e")
    [preload] = preload_processes()
    await zygote.close()
    assert not alive(pid) and not alive(preload)
    assert zygote.ended == "preload process exited with code 0" and not zygote.running
    assert str(exited.exception()) == zygote.ended, "an exit code it could not report fails, not hangs"


def test_preload_refusal_names_what_cannot_be_forked(tmp_path: Path) -> None:
    here = str(Path(PY).parent)
    env = {"PATH": here}
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(PY)
    assert preload_refusal([PY, "h.py", "-x"], env, tmp_path) is None
    assert preload_refusal(["python", "h.py"], env, tmp_path) is None
    assert preload_refusal(["python", "-m", "pkg.mod"], env, tmp_path) is None
    assert preload_refusal(["python", "-c", "pass"], env, tmp_path) == (
        "the command is not `python SCRIPT ...` or `python -m MODULE ...`"
    )
    assert preload_refusal(["python"], env, tmp_path) is not None
    assert preload_refusal(["python", "h.py"], {"PATH": str(tmp_path / "bin")}, tmp_path) == (
        f"python is not this interpreter ({PY})"
    ), "the same file in another folder is another environment (a venv)"
    assert preload_refusal(["bin/python", "h.py"], env, tmp_path) is not None
    assert preload_refusal(["sh", "-c", "x"], {"PATH": "/bin:/usr/bin"}, tmp_path) == (
        f"sh is not this interpreter ({PY})"
    )
    assert preload_refusal([PY, "h.py"], {**env, "PYTHONPATH": "/elsewhere"}, tmp_path) == (
        "the harness's env sets PYTHONPATH, read by an interpreter only at its start"
    )


OUTCOMES: dict[str, dict[str, Any]] = {
    "resultFile": {"command": [PY, "probe.py"]},
    "exitCode": {"command": [PY, "answer.py"], "outcome": {"type": "exitCode"}},
    "grader": {
        "command": [PY, "answer.py"],
        "outcome": {"type": "grader", "grader": {"command": [PY, "grader.py"], "timeoutSeconds": 10}},
    },
}


def relative(target: Path, start: Path) -> Path:
    return Path(os.path.relpath(target, start))


@pytest.mark.parametrize("preload", [False, True], ids=["exec", "preload"])
@pytest.mark.parametrize("outcome", list(OUTCOMES))
async def test_relative_directories_reach_harnesses_as_absolute_paths(
    gateway: Server,
    tmp_path: Path,
    marker_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    outcome: str,
    preload: bool,
) -> None:
    """As `make demo` runs it: started elsewhere than the harness's directory, with a relative work
    directory and base directory; a forked harness opens its files after changing into its cwd."""
    here = tmp_path / "started-here"
    here.mkdir()
    monkeypatch.chdir(here)
    harness = harness_spec(uuid.uuid4().hex, tmp_path, **OUTCOMES[outcome])
    base_dir = relative(HARNESSES, here)
    pool_name = f"relative-{outcome}-{preload}".lower()
    task = {"answer": "42", "expected": "42"}
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts([task] * 2, pool=pool_name, max_attempts=1)
        ctrl = LocalRolloutController(
            client,
            gateway.url,
            pool_name,
            RolloutPoolSpec.model_validate({"harnessRef": {"name": "h"}, **(PRELOAD if preload else {})}),
            harness,
            base_dir=base_dir,
            work_dir=Path("runs/demo/attempts"),
            kill_grace_seconds=0.5,
        )
        outs = await run_batch(ctrl, client, [r.id for r in created])
    assert [(o.status, o.reward) for o in outs] == [("succeeded", 1.0)] * 2, [o.attempts for o in outs]
    for out in outs:
        adir = here / "runs" / "demo" / "attempts" / out.attempts[0].id
        assert (adir / "stdout.log").is_file(), "the attempt's files are where the caller said"
        if outcome == "resultFile":
            seen = out.attempts[0].info["result"]["seen"]
            assert seen["preloaded"] == preload
            paths = {k: v for k, v in seen["env"].items() if k.endswith("_FILE")}
            assert paths and all(Path(v).is_absolute() for v in paths.values()), paths
            assert Path(paths["INHARNESS_RESULT_FILE"]) == adir / "result.json"


async def test_a_failure_during_an_outage_is_released_and_not_charged(
    gateway: Server, tmp_path: Path
) -> None:
    """The outage hook (`inharness run`'s supervisor) says the engine was down while the attempt ran:
    the crash is not the harness's fault. Without an outage the same crash is charged."""
    harness = harness_spec(uuid.uuid4().hex, tmp_path)
    down: list[float] = []

    async def outage(started_at: float) -> str | None:
        down.append(started_at)
        return "engine was killed by SIGKILL" if len(down) == 1 else None

    async with GatewayClient(gateway.url, ADMIN) as client:
        [created] = await client.create_rollouts([{"run": "crash"}], pool="outage", max_attempts=1)
        ctrl = LocalRolloutController(
            client,
            gateway.url,
            "outage",
            RolloutPoolSpec.model_validate({"harnessRef": {"name": "h"}}),
            harness,
            base_dir=HARNESSES,
            work_dir=tmp_path / "work",
            kill_grace_seconds=0.5,
            outage=outage,
        )
        [out] = await run_batch(ctrl, client, [created.id])
    first, second = out.attempts
    assert first.status == "released"
    assert first.failure_reason == "engine was killed by SIGKILL (was: exited with code 3)"
    assert (second.status, second.failure_reason) == ("failed", "exited with code 3")
    assert out.status == "failed" and (ctrl.released, ctrl.failed) == (1, 1), "only the second was charged"


async def test_consecutive_failures_without_a_model_call_halt_the_controller(
    gateway: Server, tmp_path: Path
) -> None:
    harness = harness_spec(uuid.uuid4().hex, tmp_path)
    tasks: list[dict[str, Any]] = [{"run": "good", "question": "Hi", "reward": 1.0}] + [{"run": "crash"}] * 6
    async with GatewayClient(gateway.url, ADMIN) as client:
        created = await client.create_rollouts(tasks, pool="halting", max_attempts=1)
        ctrl = LocalRolloutController(
            client,
            gateway.url,
            "halting",
            RolloutPoolSpec.model_validate({"harnessRef": {"name": "h"}, "parallelism": 1}),
            harness,
            base_dir=HARNESSES,
            work_dir=tmp_path / "work",
            kill_grace_seconds=0.5,
            max_consecutive_failures=3,
        )
        await asyncio.wait_for(ctrl.run(asyncio.Event()), 60)  # returns by itself once halted
        outs = [await client.get_rollout(r.id) for r in created]
    assert [o.status for o in outs] == [
        "succeeded",
        "failed",
        "failed",
        "failed",
        "queued",
        "queued",
        "queued",
    ]
    assert ctrl.fatal is not None and ctrl.halted.is_set()
    assert ctrl.fatal.startswith(
        "3 attempts in a row failed before any model call was recorded: exited with code 3"
    )
    assert str(tmp_path / "work" / outs[3].attempts[0].id / "stderr.log") in ctrl.fatal
    assert "the end of its stderr:\n    boom: the harness fell over" in ctrl.fatal, ctrl.fatal
    assert "fix: the harness failed before calling the model" in ctrl.fatal
