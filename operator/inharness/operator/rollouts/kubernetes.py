"""Kubernetes rollout backend: one bare Pod (or, with `spec.kubernetes.workload: Job`, one Job) per
claimed attempt, watched, reported, cleaned up. What the objects are: render/harness.py; how a pod's
state becomes an outcome: `outcome.POD_RULES`; the claim loop, reporting and counting:
`base.ClaimingController`, whose hooks this fills in.

Why bare Pods by default (not a Job per attempt, not an Indexed Job per batch):
- One API object per attempt. A Job per attempt adds the Job object, and the job controller's own
  watches, status writes and pod creations on top of it: twice the objects and about three times
  the API writes per attempt, for retries the gateway already does (a failed attempt requeues its
  rollout as a new attempt).
- An Indexed Job per batch cannot give each index its own task and key without a lookup per index
  (a file per index, or an init step that fetches it), its pods fail and retry as a group, and a
  per-attempt failure reason has to be dug out of the Job's pods anyway.
- Kueue admits plain Pods through its pod integration (label `kueue.x-k8s.io/queue-name`, from the
  pool's `kubernetes.queueName`), so a Job is not needed for quota either, where the cluster's
  admin has switched that integration on. Where not, `workload: Job` makes each attempt a Job of
  the same pod (`render.harness.harness_job`), which Kueue admits by default.

Either way the controller watches pods (the Job's pod carries the attempt's labels from its
template) and reads each outcome from the harness pod with the same rules; with Jobs it also watches
the Jobs, for what only a Job says (suspended, failed before or without a pod), adopts by Job, and
deletes the Job (propagationPolicy Background: its pod goes with it).

Per claimed batch (up to `max_batch` attempts): one Secret with the attempts' keys and, when the
harness takes its task as a file, one ConfigMap with their tasks. Both go once the batch's last pod
is gone. So the objects per attempt are one pod (plus its Job) and 2/`max_batch` (4 API writes per
batch). Failures that leave a pod waiting (image pull errors, Unschedulable) fail the attempt after a
grace and the pod (or Job) is deleted.

Pods are watched by label selector (list, then watch from the list's resourceVersion; a 410 Gone
re-lists), never polled; attempts are claimed in batches (one gateway request per batch) while
fewer than `parallelism` attempts are in flight (adopted ones included); creation is paced by the
KubeClient's QPS/burst.

Restart safety: on start the controller lists its pods (or Jobs) and adopts them (attempt and rollout
ids are in their labels): running ones get a heartbeat at once and then as usual, finished ones are
reported. A report repeated after a restart is answered by the gateway as a duplicate and changes
nothing (nor the counters); an attempt whose lease expired while no controller ran is refused
(409) and was requeued by the gateway. Stopping the controller (operator shutdown, changed spec)
detaches from running pods without reporting them (`Detached`), so the next controller adopts them.
"""

import asyncio
import contextlib
import heapq
import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt
from inharness.operator import render
from inharness.operator.kube import (
    CONFIGMAPS,
    JOBS,
    PODS,
    SECRETS,
    AlreadyExists,
    KubeClient,
    KubeError,
    NotFound,
    Resource,
)
from inharness.operator.render.harness import (
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_POOL,
    LABEL_ROLLOUT,
    LABEL_RUN,
    PodContext,
    batch_objects,
    batch_of,
    harness_workload,
    keys_name,
    pod_deadline,
    selector,
    tasks_name,
    workload_name,
)
from inharness.operator.rollouts.base import (
    Abort,
    ClaimingController,
    Detached,
    OnFinish,
    OnReport,
    Report,
    backoff,
    pool_settings,
    retry,
)
from inharness.operator.rollouts.outcome import Graces, Outcome, classify, finished_at, is_terminal
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec

__all__ = ["LABEL_POOL", "KubernetesRolloutController", "pool_backend_problem"]

Obj = dict[str, Any]

TASKS_PER_CONFIGMAP_BYTES = 900_000  # the API server refuses objects over about 1 MiB
KUBE_ERRORS = (KubeError, aiohttp.ClientError, TimeoutError)


def _kube_transient(exc: Exception) -> bool:
    """What may pass on a second try: 5xx, 429, connection errors."""
    if isinstance(exc, KubeError):
        return exc.status >= 500 or exc.status == 429
    return isinstance(exc, aiohttp.ClientError | TimeoutError)


def pool_backend_problem(harness: HarnessSpecSpec) -> tuple[str, str] | None:
    """Why a HarnessSpec cannot run on the kubernetes backend, as (reason, message); None: it can."""
    if harness.image is None:
        return "HarnessImageMissing", "the HarnessSpec has no image; pods need one"
    return None


@dataclass(eq=False)
class _Tracked:
    """One attempt with a pod or Job (to be) created: both as last seen, and what the controller did."""

    attempt: ClaimedAttempt
    name: str  # of the object the controller creates and deletes: the pod, or the Job
    batch: str | None
    adopted: bool = False
    pod: Obj | None = None
    job: Obj | None = None
    pod_gone: bool = False
    job_gone: bool = False
    rejected: str | None = None  # why it was never created
    deleting: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first_seen: dict[str, float] = field(default_factory=dict)
    finished: float | None = None  # monotonic time the outcome was settled, for the TTL
    failed: bool = False
    done: bool = False  # its attempt task has ended
    create: bool = False  # this controller creates the object (not adopted)

    def pod_deleted(self, jobs: bool) -> bool:
        """What classification calls gone: the pod went (or, with a Job, the Job went before its pod came)."""
        return self.pod_gone or self.rejected is not None or (jobs and self.job_gone and self.pod is None)

    def gone(self, jobs: bool) -> bool:
        """Nothing of the attempt is left on the cluster: its slot is free."""
        if self.rejected is not None:
            return True
        if not jobs:
            return self.pod_gone
        return self.job_gone and (self.pod is None or self.pod_gone)


class KubernetesRolloutController(ClaimingController):
    """Runs a RolloutPool's attempts of one TrainingRun as pods or Jobs (see the module docstring)."""

    max_batch = 100
    claim_concurrency = 8  # single claims in flight, against a gateway without batch claims
    claim_linger_seconds = 0.1  # how long a freed slot waits for others, so that batches stay large
    gateway_concurrency = 16
    watch_timeout_seconds = 300
    create_tries = 4

    def __init__(
        self,
        gateway: GatewayClient,
        kube: KubeClient,
        *,
        namespace: str,
        run: str,
        pool_name: str,
        pool_uid: str | None,
        pool: RolloutPoolSpec,
        harness: HarnessSpecSpec,
        gateway_service_url: str | None = None,
        log: Callable[[str], None] | None = None,
        on_finish: OnFinish | None = None,
        on_report: OnReport | None = None,
    ) -> None:
        super().__init__(
            gateway,
            pool_name,
            **pool_settings(pool, harness),
            log=log,
            on_finish=on_finish,
            on_report=on_report,
        )
        problem = pool_backend_problem(harness)
        if problem is not None:
            raise ValueError(problem[1])
        self.kube = kube
        self.ctx = PodContext(
            namespace=namespace,
            run=run,
            pool=pool_name,
            pool_uid=pool_uid,
            harness=harness,
            settings=pool.kubernetes,
            gateway_url=(gateway_service_url or render.gateway_url(run)).rstrip("/"),
            lease_seconds=int(self.lease_seconds),
        )
        self.jobs = pool.kubernetes.workload == "Job"
        self.workload: Resource = JOBS if self.jobs else PODS
        self.graces = Graces(
            float(pool.kubernetes.image_pull_grace_seconds),
            float(pool.kubernetes.unschedulable_grace_seconds),
        )
        self.selector = selector(run, pool_name)
        self.adopted = 0
        self._batch_claims = True  # until the gateway says it has no batch-claim endpoint
        self._tracked: dict[str, _Tracked] = {}
        self._batches: dict[str, set[str]] = {}
        self._reap = asyncio.Event()
        self._expiry: list[tuple[float, int, _Tracked]] = []  # finished attempts by finish time (heap)
        self._kept: list[tuple[float, int, _Tracked]] = []  # the newest failed ones, oldest first
        self._seq = itertools.count()
        self._helpers: list[asyncio.Task[None]] = []
        self._cleanups: set[asyncio.Task[None]] = set()  # batch deletions in flight
        self._versions: dict[Resource, str] = {}  # resourceVersion to resume each watch from

    @property
    def pods(self) -> int:
        """Attempts this controller tracks: in flight, or finished and waiting for their cleanup."""
        return len(self._tracked)

    # -- begin and end ------------------------------------------------------------------------------

    async def begin(self) -> None:
        await self._adopt()
        watched = [PODS, JOBS] if self.jobs else [PODS]
        self._helpers = [
            *(
                asyncio.create_task(self._watch(r), name=f"{self.pool_name}-watch-{r.plural}")
                for r in watched
            ),
            asyncio.create_task(self._reaper(), name=f"{self.pool_name}-reaper"),
        ]

    async def end(self) -> None:
        for task in self._helpers:
            task.cancel()
        for task in self._helpers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._cleanups:
            await asyncio.wait(list(self._cleanups), timeout=30)

    # -- adoption -----------------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Take over what a previous controller left: its pods or Jobs (each resumes, or is reported if
        finished) and batch objects that none of them needs any more."""
        pods, self._versions[PODS] = await self.kube.list_with_version(
            PODS, self.ctx.namespace, label_selector=self.selector
        )
        if self.jobs:
            jobs, self._versions[JOBS] = await self.kube.list_with_version(
                JOBS, self.ctx.namespace, label_selector=self.selector
            )
            for job in jobs:
                if self._ours(job):
                    self._adopt_object(job)
            for pod in pods:
                self._on_event(PODS, "ADDED", pod)
        else:
            for pod in pods:
                if self._ours(pod):
                    self._adopt_object(pod)
        await self._delete_unneeded_batches()

    async def _delete_unneeded_batches(self) -> None:
        needed = set(self._batches)
        for resource, name_of in ((SECRETS, keys_name), (CONFIGMAPS, tasks_name)):
            if resource is CONFIGMAPS and not self.ctx.task_as_file:
                continue
            for obj in await self.kube.list(resource, self.ctx.namespace, label_selector=self.selector):
                name = obj["metadata"]["name"]
                if self._ours(obj) and name not in {name_of(self.pool_name, b) for b in needed}:
                    await self._delete(resource, name)

    def _ours(self, obj: Mapping[str, Any]) -> bool:
        """Whether the object carries this controller's labels: the API server filters by the
        selector already, kmock's stock emulator does not, and the check costs nothing."""
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return (
            labels.get(LABEL_POOL) == self.pool_name
            and labels.get(LABEL_RUN) == self.ctx.run
            and labels.get(LABEL_COMPONENT) == "harness"
        )

    def _adopt_object(self, obj: Obj) -> None:
        """Track a pod (Pod workload) or Job (Job workload) a previous controller made, and resume it."""
        labels = obj["metadata"].get("labels") or {}
        attempt_id, rollout_id = labels.get(LABEL_ATTEMPT), labels.get(LABEL_ROLLOUT)
        if not attempt_id or not rollout_id or attempt_id in self._tracked:
            return
        attempt = ClaimedAttempt(
            id=attempt_id,
            rollout_id=rollout_id,
            group_id="",
            seq=0,
            task=None,
            token="",
            lease_expires_at=0.0,
        )
        batch = batch_of(self.pool_name, obj)
        t = _Tracked(attempt, obj["metadata"]["name"], batch, adopted=True)
        if self.jobs:
            t.job = obj
        else:
            t.pod = obj
        self._tracked[attempt_id] = t
        if batch is not None:
            self._batches.setdefault(batch, set()).add(attempt_id)
        self.adopted += 1
        self.spawn(attempt)

    # -- claiming and starting ----------------------------------------------------------------------

    async def claim(self, free: int, stopped: "asyncio.Future[Any]") -> list[ClaimedAttempt]:
        free = await self._linger(free, stopped)
        return await self._claim_batch(min(free, self.max_batch))

    async def _linger(self, free: int, stopped: "asyncio.Future[Any]") -> int:
        """Free slots to claim for, after waiting up to `claim_linger_seconds` for more to free up
        while other attempts still run. Each claimed batch costs a request and 4 API writes (its
        Secret and ConfigMap), so claiming the moment one slot frees would pay that per attempt."""
        target = min(self.max_batch, self.parallelism)
        if free >= target or free == self.parallelism or self.claim_linger_seconds <= 0:
            return free
        deadline = time.monotonic() + self.claim_linger_seconds
        while free < target and not stopped.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self.wait_for_slot(stopped, within=left)
            free = self.free_slots()
        return free

    async def _claim_batch(self, n: int) -> list[ClaimedAttempt]:
        """Up to `n` attempts: one batch-claim request, or, from a gateway that predates it (404),
        waves of single claims from then on."""
        if self._batch_claims:
            try:
                async with self.gate:
                    claimed = await self.gateway.claim_batch(
                        self.pool_name, self.lease_seconds, n, self.claim_key()
                    )
                self.claim_answered()
                return claimed
            except GatewayError as exc:
                if exc.status not in (404, 405):
                    self.claim_failed(exc)
                    return []
                self.log(f"pool {self.pool_name}: the gateway has no batch claims; claiming one at a time")
                self._batch_claims = False
            except httpx.HTTPError as exc:
                self.claim_failed(exc)
                return []
        out: list[ClaimedAttempt] = []
        while len(out) < n:
            wave = min(n - len(out), self.claim_concurrency)
            got = [
                a
                for a in await asyncio.gather(*(self.claim_one(keyed=False) for _ in range(wave)))
                if a is not None
            ]
            out += got
            if len(got) < wave:
                break
        return out

    def _split(self, attempts: list[ClaimedAttempt]) -> list[list[ClaimedAttempt]]:
        """Batches whose tasks fit one ConfigMap (only a concern when tasks go in as files)."""
        if not self.ctx.task_as_file:
            return [attempts]
        out: list[list[ClaimedAttempt]] = [[]]
        size = 0
        for a in attempts:
            n = len(json.dumps(a.task)) + len(a.id)
            if out[-1] and size + n > TASKS_PER_CONFIGMAP_BYTES:
                out.append([])
                size = 0
            out[-1].append(a)
            size += n
        return out

    async def prepare(self, attempts: list[ClaimedAttempt]) -> None:
        """Each batch's Secret (and ConfigMap); an attempt whose batch objects were refused fails."""
        for part in self._split(attempts):
            batch = part[0].id
            refused: str | None = None
            for obj in batch_objects(self.ctx, batch, part):
                try:
                    await self._create_retrying(SECRETS if obj["kind"] == "Secret" else CONFIGMAPS, obj)
                except AlreadyExists:
                    pass
                except KUBE_ERRORS as exc:
                    refused = f"BatchRejected: {obj['kind']} {obj['metadata']['name']}: {exc}"
            self._batches[batch] = {a.id for a in part}
            for a in part:
                self._tracked[a.id] = _Tracked(
                    a, workload_name(self.ctx, a.id), batch, rejected=refused, create=True
                )

    async def _create_retrying(self, resource: Resource, obj: Obj) -> Obj:
        return await retry(
            lambda: self.kube.create(resource, obj, self.ctx.namespace),
            tries=self.create_tries,
            transient=_kube_transient,
            first=0.2,
        )

    # -- one attempt --------------------------------------------------------------------------------

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        """Create the attempt's pod or Job (an adopted one exists already) and wait for its outcome. A
        stop raises `Detached` and leaves it running: stopping the operator must not fail attempts."""
        t = self._tracked[attempt.id]
        if t.rejected is not None:
            return Outcome.failure(t.rejected)
        if t.create:
            rejected = await self._create(t)
            if rejected is not None:
                return rejected
        elif not is_terminal(t.pod or {}) and not await self.heartbeat(attempt, abort):
            # an adopted one that runs: its lease ran on while no controller did
            return Outcome.failure(f"LeaseLost: {abort.reason}")
        outcome = await self._wait_outcome(t, abort)
        if outcome is None:
            raise Detached
        return outcome

    async def _create(self, t: _Tracked) -> Outcome | None:
        obj = harness_workload(self.ctx, t.attempt, t.batch or t.attempt.id)
        try:
            await self._create_retrying(self.workload, obj)
        except AlreadyExists:
            self.log(f"attempt {t.attempt.id}: {obj['kind'].lower()} {t.name} exists already; adopting it")
        except KUBE_ERRORS as exc:
            t.rejected = f"{obj['kind']}Rejected: {exc}"
            return Outcome.failure(t.rejected)
        return None

    async def _wait_outcome(self, t: _Tracked, abort: Abort) -> Outcome | None:
        aborted = asyncio.create_task(abort.wait())
        try:
            while True:
                t.changed.clear()
                outcome, recheck = classify(
                    t.pod or {},
                    gone=t.pod_deleted(self.jobs),
                    outcome_type=self.ctx.harness.outcome.type,
                    timeout_seconds=pod_deadline(self.ctx.harness),
                    graces=self.graces,
                    first_seen=t.first_seen,
                    now=time.monotonic(),
                    job=t.job,
                )
                if outcome is not None:
                    return outcome
                if abort.is_set():
                    return (
                        None if abort.reason == "stopped" else Outcome.failure(f"LeaseLost: {abort.reason}")
                    )
                timeout = None if recheck is None else max(0.0, recheck - time.monotonic())
                await self._until_changed(t, aborted, timeout)
        finally:
            aborted.cancel()

    @staticmethod
    async def _until_changed(t: _Tracked, other: "asyncio.Task[Any]", within: float | None) -> None:
        changed = asyncio.create_task(t.changed.wait())
        await asyncio.wait({changed, other}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()

    async def settle(self, attempt: ClaimedAttempt, outcome: Outcome) -> None:
        """A pod that still runs (or waits) goes before its outcome is reported."""
        t = self._tracked[attempt.id]
        if not t.gone(self.jobs) and not is_terminal(t.pod or {}):
            await self._delete_workload(t)

    async def reported(self, attempt: ClaimedAttempt, outcome: Outcome, report: Report) -> None:
        """Queue the finished pod for its TTL, and wait until a deleted one is gone before its slot is
        given to another attempt."""
        t = self._tracked[attempt.id]
        t.finished = time.monotonic()
        ended = finished_at(t.pod or {})
        if t.adopted and ended is not None:
            t.finished -= max(0.0, time.time() - ended)
        t.failed = outcome.status == "failed"
        if not t.gone(self.jobs) and not t.deleting:
            self._to_reap(t)
        if t.deleting:
            await self._wait_gone(t)

    def attempt_done(self, attempt: ClaimedAttempt) -> None:
        t = self._tracked.get(attempt.id)
        if t is not None:
            t.done = True
            self._forget_if_finished(t)

    async def _wait_gone(self, t: _Tracked) -> None:
        """Until the deleted pod is gone (its slot is free only then), the controller stops, or the
        pod's grace period has long passed (a lost node's pods can stay Terminating for good)."""
        spec = (t.pod or {}).get("spec") or {}
        deadline = time.monotonic() + float(spec.get("terminationGracePeriodSeconds") or 30) + 30
        stopping = asyncio.create_task(self.stopping.wait())
        try:
            while not t.gone(self.jobs) and not self.stopping.is_set() and time.monotonic() < deadline:
                t.changed.clear()
                await self._until_changed(t, stopping, deadline - time.monotonic())
        finally:
            stopping.cancel()

    # -- deletion and cleanup -----------------------------------------------------------------------

    async def _delete(self, resource: Resource, name: str) -> None:
        try:
            await self.kube.delete(resource, name, self.ctx.namespace)
        except NotFound:
            pass
        except KUBE_ERRORS as exc:
            self.log(f"pool {self.pool_name}: cannot delete {name}: {exc}")

    async def _delete_workload(self, t: _Tracked) -> None:
        """Delete the attempt's pod, or its Job (propagationPolicy Background: its pod goes with it)."""
        if t.deleting or t.gone(self.jobs):
            return
        t.deleting = True
        try:
            await self.kube.delete(self.workload, t.name, self.ctx.namespace)
        except NotFound:
            self._on_gone(t, self.workload)
        except KUBE_ERRORS as exc:
            t.deleting = False
            self.log(f"pool {self.pool_name}: cannot delete {t.name}: {exc}")

    def _on_gone(self, t: _Tracked, resource: Resource) -> None:
        if resource is JOBS:
            t.job_gone = True
        else:
            t.pod_gone = True
        t.changed.set()
        self._forget_if_finished(t)

    def _forget_if_finished(self, t: _Tracked) -> None:
        """Drop an attempt once its task ended and its pod is gone (or was left to the next controller);
        the batch's Secret and ConfigMap go with its last pod."""
        gone = t.gone(self.jobs)
        if not t.done or (not gone and t.finished is not None):
            return
        if self._tracked.get(t.attempt.id) is t:
            del self._tracked[t.attempt.id]
        if gone and t.batch is not None and t.batch in self._batches:
            members = self._batches[t.batch]
            members.discard(t.attempt.id)
            if not members:
                del self._batches[t.batch]
                task = asyncio.get_running_loop().create_task(self._delete_batch(t.batch))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _delete_batch(self, batch: str) -> None:
        await self._delete(SECRETS, keys_name(self.pool_name, batch))
        if self.ctx.task_as_file:
            await self._delete(CONFIGMAPS, tasks_name(self.pool_name, batch))

    def _to_reap(self, t: _Tracked) -> None:
        """Queue a finished attempt's pod for deletion after the TTL; the newest `keepFailed` failed
        ones wait in `_kept` until newer failures push them out."""
        assert t.finished is not None
        item = (t.finished, next(self._seq), t)
        keep = self.ctx.settings.keep_failed
        if t.failed and keep > 0:
            heapq.heappush(self._kept, item)
            if len(self._kept) <= keep:
                return
            item = heapq.heappop(self._kept)
        heapq.heappush(self._expiry, item)
        self._reap.set()

    async def _reaper(self) -> None:
        """Delete finished pods once their TTL has passed (O(log n) per pod, deletions concurrent)."""
        ttl = self.ctx.settings.ttl_seconds_after_finished
        while True:
            self._reap.clear()
            now = time.monotonic()
            due: list[_Tracked] = []
            while self._expiry and self._expiry[0][0] + ttl <= now:
                due.append(heapq.heappop(self._expiry)[2])
            await asyncio.gather(*(self._delete_workload(t) for t in due if not t.gone(self.jobs)))
            wait = None if not self._expiry else max(0.0, self._expiry[0][0] + ttl - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reap.wait(), wait)

    # -- the watches --------------------------------------------------------------------------------

    async def _watch(self, resource: Resource) -> None:
        failures, expired = 0, 0
        while True:
            try:
                async for kind, obj in self.kube.watch(
                    resource,
                    self.ctx.namespace,
                    label_selector=self.selector,
                    resource_version=self._versions.get(resource) or None,
                    timeout_seconds=self.watch_timeout_seconds,
                ):
                    failures, expired = 0, 0
                    version = (obj.get("metadata") or {}).get("resourceVersion")
                    if version:
                        self._versions[resource] = str(version)
                    if kind != "BOOKMARK":
                        self._on_event(resource, kind, obj)
                continue  # the server ended the watch (its timeout): resume from the last version
            except KubeError as exc:
                if exc.status == 410:  # too old a resourceVersion: start over from a fresh list
                    expired += 1
                    await self._relist(resource)
                    if expired == 1:
                        continue
                self.log(f"pool {self.pool_name}: {resource.plural} watch failed, retrying: {exc}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.log(f"pool {self.pool_name}: {resource.plural} watch broke, retrying: {exc!r}")
            failures += 1
            await asyncio.sleep(backoff(failures))

    async def _relist(self, resource: Resource) -> None:
        try:
            objs, self._versions[resource] = await self.kube.list_with_version(
                resource, self.ctx.namespace, label_selector=self.selector
            )
        except KUBE_ERRORS as exc:
            self.log(f"pool {self.pool_name}: {resource.plural} list failed: {exc}")
            self._versions[resource] = ""
            return
        live = {_attempt_of(o) for o in objs if self._ours(o)}
        for t in list(self._tracked.values()):
            seen = t.job if resource is JOBS else t.pod
            if (
                seen is not None
                and t.attempt.id not in live
                and not (t.job_gone if resource is JOBS else t.pod_gone)
            ):
                self._on_gone(t, resource)
        for obj in objs:
            self._on_event(resource, "MODIFIED", obj)

    def _on_event(self, resource: Resource, kind: str, obj: Obj) -> None:
        if not self._ours(obj):
            return
        t = self._tracked.get(_attempt_of(obj))
        if t is None:
            # made by a previous controller: adopt it (a Job's pod comes along with its Job)
            if kind != "DELETED" and resource is self.workload:
                what = "job" if resource is JOBS else "pod"
                self.log(f"pool {self.pool_name}: adopting {what} {obj['metadata']['name']} made elsewhere")
                self._adopt_object(obj)
            return
        if resource is JOBS:
            t.job = obj
        else:
            t.pod = obj
        if kind == "DELETED":
            self._on_gone(t, resource)
            return
        t.changed.set()


def _attempt_of(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT) or "")
