"""Local rollout backend: each claimed attempt runs the harness as a child process of this one.

Each harness (and grader) gets its own process group, so a timeout, a stop or a lost lease ends it
together with whatever it started; nothing is left running once an attempt is reported. Files of an
attempt (task, result, stdout, stderr) stay in `work_dir/<attempt id>/` for inspection.
"""

import asyncio
import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inharness.gateway.client import GatewayClient
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator.rollouts import Abort, ClaimingController, OnFinish, Outcome
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec

KEY_PLACEHOLDER = "inharness-key-is-in-the-url"
"""API key handed to a harness with keyIn=path: many clients refuse to start without one."""

STDERR_TAIL_BYTES = 2048
MAX_RESULT_BYTES = 1 << 20


class _Failed(Exception):
    """An attempt that ends in a failure with this reason."""


class _NoReward(_Failed):
    """The harness's result has no reward (no file, or JSON without one); `rest`: its other keys."""

    def __init__(self, reason: str, rest: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.rest = rest or {}


class NoReward(ValueError):
    """Result JSON that is an object without a 'reward' key; `rest`: its other keys."""

    def __init__(self, message: str, rest: dict[str, Any]) -> None:
        super().__init__(message)
        self.rest = rest


@dataclass(frozen=True)
class _Exit:
    """How one child process ended."""

    how: Literal["exited", "timeout", "aborted", "unstartable"]
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
    ) -> None:
        super().__init__(
            gateway,
            pool_name,
            parallelism=pool.parallelism,
            lease_seconds=pool.lease_for(harness),
            heartbeat_seconds=pool.heartbeat_seconds,
            log=log,
            on_finish=on_finish,
        )
        self.gateway_url = gateway_url.rstrip("/")
        self.pool = pool
        self.harness = harness
        self.base_dir = Path(base_dir)
        self.work_dir = Path(work_dir)
        self.kill_grace_seconds = kill_grace_seconds
        wd = Path(harness.working_dir).expanduser() if harness.working_dir else None
        self.cwd = self.base_dir if wd is None else wd if wd.is_absolute() else self.base_dir / wd

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        adir = self.work_dir / attempt.id
        adir.mkdir(parents=True, exist_ok=True)
        h, outcome = self.harness, self.harness.outcome
        result = adir / "result.json"
        env = {
            **os.environ,
            **{e.name: e.value for e in h.env},
            **self._task_env(attempt, adir / "task.json"),
        }
        env.update(self._model_env(attempt.token))
        env["INHARNESS_ATTEMPT_ID"], env["INHARNESS_ROLLOUT_ID"] = attempt.id, attempt.rollout_id
        if outcome.type != "exitCode":
            env[outcome.result_file_env] = str(result)
        stdout, stderr = adir / "stdout.log", adir / "stderr.log"

        ran = await self._run([*h.command, *h.args], env, stdout, stderr, h.timeout_seconds, abort)
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

    async def _run(
        self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path, limit_s: float, abort: Abort
    ) -> _Exit:
        """Run one child in its own process group until it exits, times out or is aborted; in every
        case (cancellation included) the whole group is gone when this returns."""
        try:
            with stdout.open("wb") as out, stderr.open("wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=self.cwd,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
        except OSError as exc:
            return _Exit("unstartable", error=str(exc))
        exited = asyncio.create_task(proc.wait())
        aborted = asyncio.create_task(abort.wait())
        how: Literal["exited", "timeout", "aborted"] = "timeout"
        try:
            done, _ = await asyncio.wait(
                {exited, aborted}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED
            )
            how = "exited" if exited in done else "aborted" if aborted in done else "timeout"
        finally:
            aborted.cancel()
            await self._end_group(proc.pid, exited)
        return _Exit(how, proc.returncode)

    async def _end_group(self, pgid: int, exited: "asyncio.Task[int]") -> None:
        """SIGTERM the group, give it the grace period, SIGKILL what is left. A group whose leader
        exited by itself only loses its stragglers."""
        if not exited.done():
            _killpg(pgid, signal.SIGTERM)
            await _poll_until(lambda: exited.done() and not _group_alive(pgid), self.kill_grace_seconds)
        if not exited.done() or _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
        await exited

        def gone() -> bool:
            if not _group_alive(pgid):
                return True
            _killpg(pgid, signal.SIGKILL)
            return False

        if not await _poll_until(gone, 10.0):
            self.log(f"process group {pgid} still has live processes after SIGKILL")


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


def parse_result(raw: bytes, who: str = "") -> tuple[float, dict[str, Any]]:
    """(reward, the other keys) of result JSON like {"reward": 1.0}, or ValueError saying what is wrong
    with it. The one set of rules for every backend: a pod's result comes from its termination message."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{who}result file is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "reward" not in data:
        raise NoReward(f"{who}result has no numeric 'reward'", data)
    reward = data.get("reward") if isinstance(data, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"{who}result has no numeric 'reward'")
    if not math.isfinite(reward):
        raise ValueError(f"{who}result 'reward' is not finite: {reward}")
    return float(reward), {k: v for k, v in data.items() if k != "reward"}
