"""The TrainingRun controller: render the children, create or patch them, read progress from the
run's gateway, and write the status.

How it converges (level-triggered):
- `reconcile` compares every rendered child with the live object and creates what is missing and
  patches what drifted (a rendered field that differs; fields the API server or others add are
  left alone). It runs on create, resume and spec updates (kopf handlers), and for every run every
  `resync_seconds` (the operator's resync loop), so a deleted or edited child comes back even when
  no event about the TrainingRun arrives.
- No kopf timer or daemon: kopf puts a finalizer on every object that has one, and a finalizer
  left behind by an uninstalled operator blocks deletion. Nothing outside Kubernetes needs cleaning
  up, so there is no finalizer: deletion is the garbage collector's, through owner references.
- One reconcile at a time per run (a lock), so handler and resync never interleave their writes;
  each reads the run afresh inside the lock, so none acts on a status another one already replaced
  (at start, resume, resync and the pool's and harness's create handlers all reconcile a run).

Status: observedGeneration, phase (Pending, Running, Suspended, Complete, Failed), progress from the
gateway's /api/v1/progress (step, modelVersion, rewardMean, rollouts done and failed, rewardHistory;
with engine verl, rayNodes of rayNodesWanted), and the conditions Ready, Progressing, Degraded,
Suspended, Complete, Failed (and RayClusterReady with engine verl: False, Waiting, "1 of 2 nodes
joined", until the trainer reports every node). A phase change and a failed reconcile are Kubernetes
Events on the TrainingRun.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import kopf
from pydantic import ValidationError

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ProgressOut
from inharness.operator import conditions as cond
from inharness.operator import render
from inharness.operator.api import GROUP, HARNESSSPEC, ROLLOUTPOOL, TRAININGRUN, VERSION
from inharness.operator.events import EventRecorder
from inharness.operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    HARNESSSPECS,
    NETWORKPOLICIES,
    PERSISTENTVOLUMECLAIMS,
    ROLLOUTPOOLS,
    SECRETS,
    SERVICES,
    STATEFULSETS,
    TRAININGRUNS,
    AlreadyExists,
    KubeClient,
    KubeError,
    NotFound,
    Resource,
)
from inharness.operator.metrics import OperatorMetrics
from inharness.operator.planning import (
    IMMUTABLE,
    Observed,
    compute_status,
    gateway_available,
    is_finished,
    is_subset,
    spec_model,
    status_changed,
    without,
)
from inharness.operator.spec import HarnessSpec, RolloutPool, TrainingRun, TrainingRunStatus

log = logging.getLogger("inharness.operator.trainingruns")

RESOURCES: dict[str, Resource] = {
    "Secret": SECRETS,
    "ConfigMap": CONFIGMAPS,
    "Service": SERVICES,
    "Deployment": DEPLOYMENTS,
    "StatefulSet": STATEFULSETS,
    "PersistentVolumeClaim": PERSISTENTVOLUMECLAIMS,
    "NetworkPolicy": NETWORKPOLICIES,
}
PROGRESS_TIMEOUT = 5.0


@dataclass
class Context:
    """What the handlers share: the API client, render settings and the operator's own state."""

    kube: KubeClient
    settings: render.RenderSettings
    events: EventRecorder
    metrics: OperatorMetrics
    gateway_url: str = render.GATEWAY_URL_TEMPLATE
    resync_seconds: float = 30.0
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    phases: dict[tuple[str, str], str] = field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)
        self.phases.pop((namespace, name), None)
        self.metrics.set_phases(self.phases)


# --- the reconcile -----------------------------------------------------------------------------------


async def _get(kube: KubeClient, resource: Resource, name: str, namespace: str) -> dict[str, Any] | None:
    try:
        return await kube.get(resource, name, namespace)
    except NotFound:
        return None


async def apply(kube: KubeClient, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create the object, or patch the live one when a rendered field drifted; returns the live one."""
    kind, meta = obj["kind"], obj["metadata"]
    resource, name, ns = RESOURCES[kind], meta["name"], meta["namespace"]
    live = await _get(kube, resource, name, ns)
    if live is None:
        try:
            return await kube.create(resource, dict(obj), ns)
        except AlreadyExists:
            live = await kube.get(resource, name, ns)
    wanted = without(obj, IMMUTABLE.get(kind, ()))
    if is_subset(wanted, live):
        return live
    log.info("%s %s/%s drifted from its rendering; patching", kind, ns, name)
    return await kube.patch(resource, name, wanted, ns)


async def _progress(
    ctx: Context, run: str, namespace: str, token: str
) -> tuple[ProgressOut | None, str | None]:
    url = ctx.gateway_url.format(name=run, namespace=namespace)
    try:
        async with GatewayClient(url, token, timeout=PROGRESS_TIMEOUT) as gw:
            return await gw.progress(), None
    except (GatewayError, httpx.HTTPError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> str | None:
    """Converge one TrainingRun; returns its phase (None: it was deleted meanwhile). Serialised per run."""
    meta = body["metadata"]
    ns, name = meta.get("namespace") or ctx.settings.namespace, meta["name"]
    async with ctx.lock(ns, name):
        try:
            # The body the caller holds was read before the lock: a reconcile that held it meanwhile
            # may have written the status (and posted its phase change), so start from the live one.
            try:
                body = await ctx.kube.get(TRAININGRUNS, name, ns)
            except NotFound:
                ctx.forget(ns, name)
                return None
            phase = await _reconcile(ctx, body, ns, name)
        except Exception as exc:
            ctx.metrics.reconciled("TrainingRun", "error")
            ctx.metrics.error("TrainingRun", type(exc).__name__)
            await ctx.events.warn(body, "ReconcileError", f"{type(exc).__name__}: {exc}")
            raise
        ctx.metrics.reconciled("TrainingRun", "ok")
        return phase


async def _reconcile(ctx: Context, body: Mapping[str, Any], ns: str, name: str) -> str | None:
    meta = body["metadata"]
    current: dict[str, Any] = dict(body.get("status") or {})
    generation = int(meta.get("generation") or 1)
    spec = body.get("spec") or {}
    base = {
        "generation": generation,
        "total_steps": int(spec.get("steps") or 1),
        "suspended": bool(spec.get("suspend")),
    }
    try:
        run = spec_model(TrainingRun, body)
    except ValidationError as exc:
        return await _write_status(ctx, body, current, Observed(**base, invalid=_first_error(exc)))

    observed = await _apply_children(ctx, run, meta, ns, name, current, base)
    return await _write_status(ctx, body, current, observed)


async def _apply_children(
    ctx: Context,
    run: TrainingRun,
    meta: Mapping[str, Any],
    ns: str,
    name: str,
    current: Mapping[str, Any],
    base: dict[str, Any],
) -> Observed:
    kube = ctx.kube
    try:
        pool, harness = await _pool_and_harness(kube, run, ns)
    except _Unusable as exc:
        return Observed(**base, problem=(exc.reason, exc.message))
    config_hash = render.config_sha256(run, pool, harness, ns)
    secret = await _get(kube, SECRETS, render.gateway_name(name), ns)
    token = render.admin_token_of(secret) or render.new_admin_token()

    live_gateway = await _get(kube, DEPLOYMENTS, render.gateway_name(name), ns)
    progress, progress_error = None, None
    if gateway_available(live_gateway):
        progress, progress_error = await _progress(ctx, name, ns, token)
    trainer = run.spec.trainer
    observed = Observed(
        **base,
        config_sha256=config_hash,
        gateway=live_gateway,
        progress=progress,
        progress_error=progress_error,
        ray_nodes_wanted=trainer.nodes if trainer.engine == "verl" else None,
    )
    children = render.render_children(
        run,
        pool,
        harness,
        settings=ctx.settings,
        admin_token=token,
        owner_uid=meta.get("uid"),
        finished=is_finished(current, observed),
    )
    applied, refused = await _apply_all(kube, children)
    return dataclasses.replace(
        observed,
        gateway=applied.get("Deployment", live_gateway),
        trainer=applied.get("StatefulSet"),
        problem=("ApplyFailed", "; ".join(refused)) if refused else None,
    )


M = TypeVar("M", RolloutPool, HarnessSpec)


class _Unusable(Exception):
    """The run's RolloutPool or HarnessSpec is missing or invalid: (reason, message) for its status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


async def _pool_and_harness(kube: KubeClient, run: TrainingRun, ns: str) -> tuple[RolloutPool, HarnessSpec]:
    """The run's RolloutPool and its HarnessSpec, or `_Unusable` saying why they cannot be had."""
    pool = await _load(kube, ROLLOUTPOOLS, RolloutPool, run.spec.rollout_pool_ref.name, ns)
    return pool, await _load(kube, HARNESSSPECS, HarnessSpec, pool.spec.harness_ref.name, ns)


async def _load(kube: KubeClient, resource: Resource, model: type[M], name: str, ns: str) -> M:
    """The named object as its spec model; `_Unusable` (`<Kind>NotFound`, `Invalid<Kind>`) if it cannot be."""
    kind = model.__name__
    body = await _get(kube, resource, name, ns)
    if body is None:
        raise _Unusable(f"{kind}NotFound", f'no {kind} "{name}" in {ns}')
    try:
        return spec_model(model, body)
    except ValidationError as exc:
        raise _Unusable(f"Invalid{kind}", _first_error(exc)) from None


async def _apply_all(
    kube: KubeClient, children: list[dict[str, Any]]
) -> tuple[dict[str, Mapping[str, Any]], list[str]]:
    """Apply every child, even when one is refused, so one bad field does not hold up the rest:
    (the applied objects by kind, what was refused and why)."""
    applied: dict[str, Mapping[str, Any]] = {}
    refused: list[str] = []
    for child in children:
        try:
            applied[child["kind"]] = await apply(kube, child)
        except KubeError as exc:
            refused.append(f"{child['kind']} {child['metadata']['name']}: {exc}")
    return applied, refused


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {err['msg']}{more}"


async def _write_status(
    ctx: Context, body: Mapping[str, Any], current: dict[str, Any], observed: Observed
) -> str | None:
    meta = body["metadata"]
    ns, name = meta.get("namespace") or ctx.settings.namespace, meta["name"]
    # Through the status model: what is patched has the shape the CRD's status schema declares.
    computed = compute_status(current, observed, cond.now_rfc3339())
    new = TrainingRunStatus.model_validate(computed).model_dump(mode="json", by_alias=True)
    if status_changed(current, new):
        try:
            await ctx.kube.patch(TRAININGRUNS, name, {"status": new}, ns, subresource="status")
        except NotFound:
            ctx.forget(ns, name)  # deleted while this reconcile ran: nothing left to report on
            return None
    was = cond.find(current.get("conditions"), "Degraded") or {}
    now_degraded = cond.find(new["conditions"], "Degraded") or {}
    if now_degraded.get("status") == "True" and (was.get("status"), was.get("reason")) != (
        "True",
        now_degraded.get("reason"),
    ):
        ctx.metrics.error("TrainingRun", str(now_degraded["reason"]))
        await ctx.events.warn(body, str(now_degraded["reason"]), str(now_degraded.get("message") or ""))
    old_phase, phase = current.get("phase"), new["phase"]
    if old_phase != phase:
        why = next((c for c in new["conditions"] if c["type"] == _WHY.get(phase, "Progressing")), None)
        message = f"{old_phase or 'new'} -> {phase}" + (
            f": {why['message']}" if why and why["message"] else ""
        )
        if phase in ("Failed",) or (phase == "Pending" and observed.problem):
            await ctx.events.warn(body, phase, message)
        else:
            await ctx.events.info(body, phase, message)
    ctx.phases[(ns, name)] = phase
    ctx.metrics.set_phases(ctx.phases)
    return phase


_WHY = {"Failed": "Failed", "Pending": "Ready", "Complete": "Complete", "Suspended": "Suspended"}


# --- kopf handlers -----------------------------------------------------------------------------------


def context(memo: Any) -> Context:
    return memo.trainingruns


@kopf.on.resume(GROUP, VERSION, TRAININGRUN.plural)
@kopf.on.create(GROUP, VERSION, TRAININGRUN.plural)
@kopf.on.update(GROUP, VERSION, TRAININGRUN.plural, field="spec")
async def on_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    try:
        await reconcile(context(memo), body)
    except KubeError as exc:
        raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=5) from exc


@kopf.on.event(GROUP, VERSION, TRAININGRUN.plural)
async def on_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A deleted run: nothing to clean up (owner references do it), so no finalizer and no
    deletion handler; the operator only forgets the run's lock and phase."""
    if event["type"] == "DELETED":
        meta = body["metadata"]
        context(memo).forget(meta.get("namespace") or "", meta["name"])


async def _referencing_runs(
    ctx: Context, namespace: str, *, pool: str | None = None, harness: str | None = None
) -> list[dict[str, Any]]:
    runs = await ctx.kube.list(TRAININGRUNS, namespace)
    if pool is not None:
        return [r for r in runs if ((r.get("spec") or {}).get("rolloutPoolRef") or {}).get("name") == pool]
    pools = await ctx.kube.list(ROLLOUTPOOLS, namespace)
    names = {
        p["metadata"]["name"]
        for p in pools
        if ((p.get("spec") or {}).get("harnessRef") or {}).get("name") == harness
    }
    return [r for r in runs if ((r.get("spec") or {}).get("rolloutPoolRef") or {}).get("name") in names]


@kopf.on.create(GROUP, VERSION, ROLLOUTPOOL.plural)
@kopf.on.update(GROUP, VERSION, ROLLOUTPOOL.plural, field="spec")
async def on_pool_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A run's config includes its pool: re-render the runs that use this one (and the pool may
    have arrived after its run)."""
    ctx = context(memo)
    try:
        for run in await _referencing_runs(ctx, body["metadata"]["namespace"], pool=body["metadata"]["name"]):
            await reconcile(ctx, run)
    except KubeError as exc:
        raise kopf.TemporaryError(f"reconcile of the pool's runs failed: {exc}", delay=5) from exc


@kopf.on.create(GROUP, VERSION, HARNESSSPEC.plural)
@kopf.on.update(GROUP, VERSION, HARNESSSPEC.plural, field="spec")
async def on_harness_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    ctx = context(memo)
    try:
        for run in await _referencing_runs(
            ctx, body["metadata"]["namespace"], harness=body["metadata"]["name"]
        ):
            await reconcile(ctx, run)
    except KubeError as exc:
        raise kopf.TemporaryError(f"reconcile of the harness's runs failed: {exc}", delay=5) from exc


async def resync_forever(ctx: Context, namespaces: list[str] | None) -> None:
    """Every resync_seconds, reconcile every TrainingRun in the watched namespaces (None: all)."""
    while True:
        for ns in namespaces or [None]:
            try:
                runs = await ctx.kube.list(TRAININGRUNS, ns)
            except KubeError as exc:
                log.warning("resync: cannot list TrainingRuns in %s: %s", ns or "all namespaces", exc)
                ctx.metrics.error("TrainingRun", "ListFailed")
                continue
            listed = {(r["metadata"].get("namespace") or "", r["metadata"]["name"]) for r in runs}
            for key in [k for k in ctx.phases if (ns is None or k[0] == ns) and k not in listed]:
                ctx.forget(*key)  # deleted while a watch event about it was missed
            for run in runs:
                if (run.get("metadata") or {}).get("deletionTimestamp"):
                    continue
                try:
                    await reconcile(ctx, run)
                except Exception:
                    log.exception("resync of TrainingRun %s/%s failed", ns, run["metadata"]["name"])
        await asyncio.sleep(ctx.resync_seconds)
