"""The RolloutPool controller: for every TrainingRun whose RolloutPool has backend `kubernetes` and
whose gateway is up, a `KubernetesRolloutController` that runs the run's attempts as pods; and the
pool's status.

How it runs (level-triggered, like the TrainingRun controller):
- One manager task, started with the operator, syncs every few seconds: it lists the runs, pools
  and harness specs of each watched namespace, works out which (run, pool) controllers should run,
  and starts, restarts (the pool's or harness's spec changed, a new admin token) or stops them. A
  stopped controller leaves its pods running; the next one adopts them.
- No kopf daemon or timer: kopf puts a finalizer on every object that has one, and a finalizer
  left behind by an uninstalled operator blocks deletion (docs/operator.md). kopf event handlers
  only wake the manager when a pool, harness spec or run appears, goes, changes its spec (its
  generation) or, for a run, its phase, so a new pool or a gateway coming up is seen at once.
- A controller reaches its run's gateway at the operator's --gateway-url (with the admin token
  from the run's Secret, as the TrainingRun controller does); harness pods reach it through the
  gateway Service.

Status (through RolloutPoolStatus, the CRD's status schema): observedGeneration; queued (the
gateway's queued rollouts), running (attempts in flight), succeeded and failed (attempts this pool's
controllers reported; kept across operator restarts by starting from the previous status); and
the conditions Ready (a controller runs, else why not: NoTrainingRun, GatewayNotReady,
HarnessSpecNotFound, InvalidHarnessSpec, InvalidRolloutPool, HarnessImageMissing,
BackendLocal), Degraded (True, with the failure's reason, when most of the
last attempts failed for the same cause: OOMKilled, ImagePullBackOff, Unschedulable, ...) and
GatewayReachable (False, reason GatewayUnreachable, while a controller's claims fail: since when
and the last error; the controller backs off meanwhile, rollouts/base.py). A Degraded turning True
or changing reason, and GatewayReachable turning False, are Warning Events on the pool.
"""

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import kopf
from pydantic import ValidationError

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator import conditions as cond
from inharness.operator import render
from inharness.operator.api import GROUP, HARNESSSPEC, ROLLOUTPOOL, TRAININGRUN, VERSION
from inharness.operator.events import EventRecorder
from inharness.operator.kube import (
    DEPLOYMENTS,
    HARNESSSPECS,
    ROLLOUTPOOLS,
    SECRETS,
    TRAININGRUNS,
    KubeClient,
    KubeError,
    NotFound,
)
from inharness.operator.metrics import OperatorMetrics
from inharness.operator.planning import gateway_available, spec_model, status_changed
from inharness.operator.rollouts import Outcome, reason_key
from inharness.operator.rollouts.kubernetes import KubernetesRolloutController, pool_backend_problem
from inharness.operator.spec import (
    HarnessSpec,
    HarnessSpecSpec,
    RolloutPool,
    RolloutPoolSpec,
    RolloutPoolStatus,
)

log = logging.getLogger("inharness.operator.pools")

DEGRADED_WINDOW = 20  # the last attempts the Degraded condition looks at
DEGRADED_MIN = 4  # fewer outcomes than this (e.g. after a restart) leave Degraded as it was
STOP_SECONDS = 60.0


@dataclass
class _PoolState:
    """What the operator remembers of one pool between syncs."""

    succeeded: int = 0
    failed: int = 0
    recent: deque[str | None] = field(default_factory=lambda: deque(maxlen=DEGRADED_WINDOW))
    last_reason: dict[str, str] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)  # per run


@dataclass(frozen=True)
class _Want:
    namespace: str
    run: str
    pool: str
    pool_uid: str | None
    spec: RolloutPoolSpec
    harness: HarnessSpecSpec
    token: str
    fingerprint: tuple[Any, ...]


@dataclass
class _Live:
    want: _Want
    controller: KubernetesRolloutController
    gateway: GatewayClient
    stop: asyncio.Event
    task: asyncio.Task[None]


class PoolManager:
    def __init__(
        self,
        kube: KubeClient,
        events: EventRecorder,
        metrics: OperatorMetrics,
        *,
        gateway_url: str,
        namespaces: list[str] | None,
        interval: float = 5.0,
        min_interval: float = 0.5,
    ) -> None:
        self.kube = kube
        self.events = events
        self.metrics = metrics
        self.gateway_url = gateway_url
        self.namespaces = namespaces
        self.interval = interval
        self.min_interval = min_interval
        self.wake = asyncio.Event()
        self._live: dict[tuple[str, str], _Live] = {}
        self._pools: dict[tuple[str, str], _PoolState] = {}
        self._seen: dict[tuple[str, str, str], tuple[Any, ...]] = {}

    # -- waking -------------------------------------------------------------------------------------

    def notice(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Wake the manager when an event changes what it would decide (not for status writes)."""
        meta = body.get("metadata") or {}
        key = (kind, str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if event_type == "DELETED":
            self._seen.pop(key, None)
            self.wake.set()
            return
        phase = ((body.get("status") or {}).get("phase"),) if kind == "TrainingRun" else ()
        seen = (meta.get("uid"), meta.get("generation"), bool(meta.get("deletionTimestamp")), *phase)
        if self._seen.get(key) != seen:
            self._seen[key] = seen
            self.wake.set()

    async def run_forever(self) -> None:
        while True:
            self.wake.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("rollout pools: sync failed")
                self.metrics.reconciled("RolloutPool", "error")
            await asyncio.sleep(self.min_interval)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(0.0, self.interval - self.min_interval))

    async def close(self) -> None:
        """Stop every controller (their pods run on, for the next operator to adopt)."""
        await asyncio.gather(*(self._stop(key) for key in list(self._live)))

    # -- one sync -----------------------------------------------------------------------------------

    async def sync(self) -> None:
        wanted: dict[tuple[str, str], _Want] = {}
        pools: list[tuple[dict[str, Any], tuple[str, str] | None]] = []
        for ns in self.namespaces or [None]:
            try:
                runs = await self.kube.list(TRAININGRUNS, ns)
                pool_bodies = await self.kube.list(ROLLOUTPOOLS, ns)
                harnesses = await self.kube.list(HARNESSSPECS, ns)
            except KubeError as exc:
                log.warning("rollout pools: cannot list in %s: %s", ns or "all namespaces", exc)
                self.metrics.error("RolloutPool", "ListFailed")
                return
            by_name = {(h["metadata"].get("namespace") or "", h["metadata"]["name"]): h for h in harnesses}
            for body in pool_bodies:
                problem = await self._plan(body, runs, by_name, wanted)
                pools.append((body, problem))

        for key in [
            k
            for k, live in self._live.items()
            if k not in wanted or wanted[k].fingerprint != live.want.fingerprint or live.task.done()
        ]:
            await self._stop(key)
        for key, want in wanted.items():
            if key not in self._live:
                self._start(want)
        for body, problem in pools:
            await self._write_status(body, problem)
        self.metrics.reconciled("RolloutPool", "ok")

    async def _plan(
        self,
        body: dict[str, Any],
        runs: list[dict[str, Any]],
        harnesses: Mapping[tuple[str, str], dict[str, Any]],
        wanted: dict[tuple[str, str], _Want],
    ) -> tuple[str, str] | None:
        """Add the controllers this pool should have to `wanted`; returns why it has none, if so."""
        meta = body["metadata"]
        ns, name = meta.get("namespace") or "", meta["name"]
        self._state(body)
        try:
            pool = spec_model(RolloutPool, body)
        except ValidationError as exc:
            return "InvalidRolloutPool", _first_error(exc)
        if pool.spec.backend != "kubernetes":
            return (
                "BackendLocal",
                "backend local: `inharness run` runs this pool's harnesses, not the operator",
            )
        h_name = pool.spec.harness_ref.name
        h_body = harnesses.get((ns, h_name))
        if h_body is None:
            return "HarnessSpecNotFound", f'no HarnessSpec "{h_name}" in {ns}'
        try:
            harness = spec_model(HarnessSpec, h_body)
        except ValidationError as exc:
            return "InvalidHarnessSpec", _first_error(exc)
        problem = pool_backend_problem(harness.spec)
        if problem is not None:
            return problem
        mine = _runs_using(runs, ns, name)
        if not mine:
            return "NoTrainingRun", f'no TrainingRun in {ns} uses RolloutPool "{name}"'
        waiting = []
        for run in mine:
            run_name = run["metadata"]["name"]
            token = await self._gateway_token(ns, run_name)
            if token is None:
                waiting.append(run_name)
                continue
            fingerprint = _fingerprint(meta, h_body["metadata"], token)
            wanted[(ns, run_name)] = _Want(
                namespace=ns,
                run=run_name,
                pool=name,
                pool_uid=meta.get("uid"),
                spec=pool.spec,
                harness=harness.spec,
                token=token,
                fingerprint=fingerprint,
            )
        if len(waiting) == len(mine):
            return "GatewayNotReady", f"the gateway of TrainingRun {', '.join(waiting)} is not available yet"
        return None

    async def _gateway_token(self, ns: str, run: str) -> str | None:
        """The admin token of the run's gateway once that gateway is available, else None."""
        try:
            deployment = await self.kube.get(DEPLOYMENTS, render.gateway_name(run), ns)
            if not gateway_available(deployment):
                return None
            return render.admin_token_of(await self.kube.get(SECRETS, render.gateway_name(run), ns))
        except NotFound:
            return None

    # -- controllers --------------------------------------------------------------------------------

    def _start(self, want: _Want) -> None:
        url = self.gateway_url.format(name=want.run, namespace=want.namespace)
        gateway = GatewayClient(url, want.token, timeout=30.0)
        state = self._pools[(want.namespace, want.pool)]

        def finished(_: ClaimedAttempt, outcome: Outcome) -> None:
            if outcome.status == "succeeded":
                state.succeeded += 1
                state.recent.append(None)
                return
            state.failed += 1
            key = reason_key(outcome.reason or "failed")
            state.recent.append(key)
            state.last_reason[key] = outcome.reason or key

        def say(message: str) -> None:
            log.info("%s/%s: %s", want.namespace, want.run, message)

        def warn(message: str) -> None:
            log.warning("%s/%s: %s", want.namespace, want.run, message)

        controller = KubernetesRolloutController(
            gateway,
            self.kube,
            namespace=want.namespace,
            run=want.run,
            pool_name=want.pool,
            pool_uid=want.pool_uid,
            pool=want.spec,
            harness=want.harness,
            log=say,
            on_finish=finished,
        )
        controller.warn = warn
        stop = asyncio.Event()
        task = asyncio.create_task(
            self._run(controller, stop, want), name=f"pool-{want.namespace}-{want.run}"
        )
        self._live[(want.namespace, want.run)] = _Live(want, controller, gateway, stop, task)
        log.info(
            "rollout pool %s/%s: controller started for TrainingRun %s", want.namespace, want.pool, want.run
        )

    async def _run(self, controller: KubernetesRolloutController, stop: asyncio.Event, want: _Want) -> None:
        try:
            await controller.run(stop)
        except Exception:
            log.exception("rollout pool %s/%s: controller for %s failed", want.namespace, want.pool, want.run)
            self.metrics.error("RolloutPool", "ControllerFailed")
            self.wake.set()

    async def _stop(self, key: tuple[str, str]) -> None:
        live = self._live.pop(key)
        live.stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(live.task), STOP_SECONDS)
        except TimeoutError:
            live.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await live.task
        await live.gateway.aclose()

    # -- status -------------------------------------------------------------------------------------

    def _state(self, body: Mapping[str, Any]) -> _PoolState:
        """The pool's remembered state; on first sight (e.g. after an operator restart) the counts
        continue from its status."""
        meta = body["metadata"]
        key = (meta.get("namespace") or "", meta["name"])
        if key not in self._pools:
            status = body.get("status") or {}
            self._pools[key] = _PoolState(
                succeeded=int(status.get("succeeded") or 0), failed=int(status.get("failed") or 0)
            )
        return self._pools[key]

    async def _write_status(self, body: dict[str, Any], problem: tuple[str, str] | None) -> None:
        meta = body["metadata"]
        ns, name = meta.get("namespace") or "", meta["name"]
        current: dict[str, Any] = dict(body.get("status") or {})
        key = (ns, name)
        state = self._state(body)
        lives = [live for live in self._live.values() if (live.want.namespace, live.want.pool) == key]
        for live in lives:
            with contextlib.suppress(GatewayError, httpx.HTTPError, ValueError):
                state.queued[live.want.run] = (await live.gateway.progress()).rollouts.get("queued", 0)
        runs = {live.want.run for live in lives}
        state.queued = {run: n for run, n in state.queued.items() if run in runs}

        if lives:
            ready = cond.condition(
                "Ready", True, "Running", f"running the attempts of {', '.join(sorted(runs))}"
            )
        else:
            reason, message = problem or ("GatewayNotReady", "waiting for a TrainingRun's gateway")
            ready = cond.condition("Ready", False, reason, message)
        degraded = self._degraded(state, current)
        reachable = _gateway_reachable(lives)
        generation = int(meta.get("generation") or 1)
        new = RolloutPoolStatus.model_validate(
            {
                "observedGeneration": generation,
                "queued": sum(state.queued.values()),
                "running": sum(live.controller.running for live in lives),
                "succeeded": state.succeeded,
                "failed": state.failed,
                "conditions": cond.merge(
                    current.get("conditions"),
                    [ready, degraded, reachable],
                    generation=generation,
                    now=cond.now_rfc3339(),
                ),
            }
        ).model_dump(mode="json", by_alias=True)
        if not status_changed(current, new):
            return
        try:
            await self.kube.patch(ROLLOUTPOOLS, name, {"status": new}, ns, subresource="status")
        except NotFound:
            self._pools.pop(key, None)
            return
        except KubeError as exc:
            log.warning("rollout pool %s/%s: status not written: %s", ns, name, exc)
            self.metrics.error("RolloutPool", "StatusFailed")
            return
        was = cond.find(current.get("conditions"), "Degraded") or {}
        if degraded["status"] == "True" and (was.get("status"), was.get("reason")) != (
            "True",
            degraded["reason"],
        ):
            self.metrics.error("RolloutPool", degraded["reason"])
            await self.events.warn(body, degraded["reason"], degraded["message"])
        was = cond.find(current.get("conditions"), "GatewayReachable") or {}
        if reachable["status"] == "False" and was.get("status") != "False":
            self.metrics.error("RolloutPool", reachable["reason"])
            await self.events.warn(body, reachable["reason"], reachable["message"])

    @staticmethod
    def _degraded(state: _PoolState, current: Mapping[str, Any]) -> dict[str, Any]:
        window = list(state.recent)
        if len(window) < DEGRADED_MIN:
            previous = cond.find(current.get("conditions"), "Degraded")
            if previous is not None:
                return cond.condition(
                    "Degraded", previous["status"], previous["reason"], previous.get("message", "")
                )
            return cond.condition("Degraded", False, "AsExpected")
        failures = Counter(k for k in window if k is not None)
        if failures:
            top, count = failures.most_common(1)[0]
            if count * 2 > len(window):
                message = (
                    f"{count} of the last {len(window)} attempts failed with {top}: {state.last_reason[top]}"
                )
                return cond.condition("Degraded", True, _condition_reason(top), message[:4096])
        return cond.condition("Degraded", False, "AsExpected")


def _gateway_reachable(lives: list[_Live]) -> dict[str, Any]:
    """GatewayReachable: False while a controller's claims fail (since when, and the last error),
    True while they pass, Unknown when no controller claims."""
    if not lives:
        return cond.condition("GatewayReachable", "Unknown", "NoController", "no controller claims attempts")
    failing = sorted(
        (live.want.run, live.controller.claim_trouble)
        for live in lives
        if live.controller.claim_trouble is not None
    )
    if not failing:
        runs = ", ".join(sorted(live.want.run for live in lives))
        return cond.condition("GatewayReachable", True, "Claiming", f"claims reach the gateway of {runs}")
    message = "; ".join(
        f"cannot claim from the gateway of TrainingRun {run} since {_rfc3339(t.since)}: {t.reason}"
        for run, t in failing
        if t is not None
    )
    return cond.condition("GatewayReachable", False, "GatewayUnreachable", message[:4096])


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition_reason(key: str) -> str:
    """A failure key as a metav1.Condition reason (CamelCase letters and digits)."""
    cleaned = "".join(ch for ch in key if ch.isalnum() or ch == "_")
    return cleaned if cleaned[:1].isalpha() else f"Failed{cleaned}"


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}"


# --- kopf handlers: wake the manager -----------------------------------------------------------------


def _notice(memo: Any, kind: str, event: Mapping[str, Any], body: Mapping[str, Any]) -> None:
    manager: PoolManager | None = getattr(memo, "pools", None)
    if manager is not None:
        manager.notice(kind, event.get("type"), body)


@kopf.on.event(GROUP, VERSION, ROLLOUTPOOL.plural)
async def on_pool_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _notice(memo, "RolloutPool", event, body)


@kopf.on.event(GROUP, VERSION, HARNESSSPEC.plural)
async def on_harness_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _notice(memo, "HarnessSpec", event, body)


@kopf.on.event(GROUP, VERSION, TRAININGRUN.plural)
async def on_run_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _notice(memo, "TrainingRun", event, body)


def _runs_using(runs: list[dict[str, Any]], ns: str, pool: str) -> list[dict[str, Any]]:
    """The TrainingRuns of namespace `ns` that name this pool and are not being deleted."""
    return [
        r
        for r in runs
        if (r["metadata"].get("namespace") or "") == ns
        and ((r.get("spec") or {}).get("rolloutPoolRef") or {}).get("name") == pool
        and not r["metadata"].get("deletionTimestamp")
    ]


def _fingerprint(
    pool_meta: Mapping[str, Any], harness_meta: Mapping[str, Any], token: str
) -> tuple[Any, ...]:
    """What a running controller was made from: a new pool or harness generation, or token, restarts it."""
    return (
        pool_meta.get("uid"),
        pool_meta.get("generation"),
        harness_meta.get("uid"),
        harness_meta.get("generation"),
        token,
    )
