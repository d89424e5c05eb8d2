"""A FAKE kubelet (and scheduler) for harness pods on kmock's emulator, plus the emulator settings
the rollout tests and bench need. No kubelet, scheduler or container runtime can run here, so this
plays their part through the API, as they would: it watches pods and writes their status.

What it does per new pod, driven by the `kubelet` entry of the pod's task (env INHARNESS_TASK):
- resolves the container's env like a kubelet: a `secretKeyRef` must name an existing Secret and
  key, a task volume an existing ConfigMap and key, else the container waits in
  CreateContainerConfigError; the resolved env is kept in `env` for the tests;
- `do`: succeed (default; writes `result`, default {"reward": 1.0}, as the termination message),
  exit (code `code`, message `message`), oom, evict, delete (the pod is deleted while running),
  image-pull (waits in ErrImagePull/ImagePullBackOff), unschedulable (PodScheduled False);
- runs for `seconds`, or until the test releases gate `hold`; past the pod's activeDeadlineSeconds
  it fails the pod with DeadlineExceeded, as the kubelet does;
- the termination message is what the harness wrote to its result file, so it only arrives when
  the result-file env var names the container's terminationMessagePath (truncated to 4096 bytes);
  a result file in an emptyDir the container mounts is kept as that volume's file instead;
- init containers (how a graded pod runs its harness): the first one plays the script as above,
  as an init container does (the pod stays Pending, its container waits in PodInitializing); exit
  0 starts the pod's container, the grader, which plays the script's `grader` entry: `do` succeed
  (writes `result`), echo (writes what its INHARNESS_HARNESS_RESULT_FILE holds, read through its
  mounts), exit (`code`, `message`) or oom; a non-zero exit of the harness fails the pod and the
  grader never starts. activeDeadlineSeconds counts for both together.

It also counts, on every pod watch event, the pods that exist and are not finished (`max_active`,
`active_over` for a limit): how the tests check parallelism without sampling.

`FakeJobController` plays the job controller and the garbage collector for harness Jobs, as thinly:
a Job that is not suspended gets one pod from its template (owned by the Job, labelled
`batch.kubernetes.io/job-name` and `job-name`), once; a suspended one none until it is resumed (what
Kueue does on admission); the pod's end sets the Job's status (Complete, or Failed with the reason
the real controller names: PodFailurePolicy for a non-zero exit, BackoffLimitExceeded for a pod
deleted or failed otherwise); a deleted Job's pod is deleted (propagationPolicy Background). It
does not enforce the Job's activeDeadlineSeconds (the pod's own deadline, enforced by the fake
kubelet, comes first by design), nor ttlSecondsAfterFinished, nor restart failed pods.
"""

import asyncio
import base64
import contextlib
import json
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kmock import action
from kube_emulator import EmulatedCluster

from inharness.operator.kube import CONFIGMAPS, JOBS, PODS, SECRETS, KubeClient, KubeError, NotFound

_IMAGE = {"image": "example.org/harness:fake", "imageID": "example.org/harness@sha256:0"}
MESSAGE_LIMIT = 4096


class RolloutCluster(EmulatedCluster):
    """The emulator with what many pods need and kmock leaves out:
    - label selectors on list and watch (equality, inequality and existence terms);
    - a watch without gaps: kmock snapshots the objects and only then subscribes to changes, so
      an object created in between was never sent; here the subscription comes first;
    - a watch's `timeoutSeconds`: the server ends the stream after it, as a real one does;
    - `expire_versions`: while set, a watch from a resourceVersion gets a 410 Gone ERROR event (what a
      real API server answers for a compacted version), once per setting;
    - constant cost per request: kmock keeps every request and matches each new one against that
      whole history, and keeps deleted objects; here only the request in flight is kept and a
      deleted object is forgotten once its DELETED event went out.
    """

    expire_versions = False

    async def _handle(self, request: Any) -> Any:
        del self._requests[:-1]
        for payload in self._payloads:  # each reaction keeps the requests it served, too
            del payload._requests[:]
        try:
            return await super()._handle(request)
        finally:
            if request.resource is not None and request.action == action.DELETE and request.name:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and self.objects[key].deleted:
                    del self.objects[key]

    def _matching(self, request: Any) -> list[dict[str, Any]]:
        wanted = _selector(request.params.get("labelSelector") or "")
        out = []
        for (resource, namespace, _name), obj in self.objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if _labels_match(wanted, obj.raw):
                out.append(obj.raw)
        return out

    async def _serve_list(self, request: Any) -> Any:
        async with self._lock:
            items = self._matching(request)
        return {"metadata": {"resourceVersion": "..."}, "items": items}

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        yield b""
        if self.expire_versions and request.params.get("resourceVersion"):
            self.expire_versions = False
            status = {"kind": "Status", "status": "Failure", "code": 410, "reason": "Expired"}
            yield {"type": "ERROR", "object": {**status, "message": "too old resource version"}}
            return
        wanted = _selector(request.params.get("labelSelector") or "")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        bus = self._buses[request.resource]
        async with self._lock:
            marker = await bus.mark()
            events = [{"type": "ADDED", "object": raw} for raw in self._matching(request)]
        stream = bus.stream(since=marker)
        ends = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            for event in events:
                yield event
            while True:
                left = None if ends is None else ends - asyncio.get_running_loop().time()
                try:
                    event = await asyncio.wait_for(anext(stream), left)
                except TimeoutError:
                    return
                obj = event.get("object") or {}
                namespace = (obj.get("metadata") or {}).get("namespace")
                if request.namespace is not None and namespace != request.namespace:
                    continue
                if _labels_match(wanted, obj):
                    yield event
        finally:
            await stream.aclose()
            await bus.unmark(marker)


def _selector(text: str) -> list[tuple[str, str, str | None]]:
    terms: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif term.startswith("!"):
            terms.append(("!", term[1:].strip(), None))
        else:
            terms.append(("exists", term, None))
    return terms


def _labels_match(terms: list[tuple[str, str, str | None]], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for op, key, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "!" and key in labels:
            return False
        if op == "exists" and key not in labels:
            return False
    return True


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeKubelet:
    """See the module docstring. Use as `async with FakeKubelet(kube, namespace) as kubelet:`."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        *,
        task_env: str = "INHARNESS_TASK",
        result_file_env: str = "INHARNESS_RESULT_FILE",
        limit: int | None = None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.task_env = task_env
        self.result_file_env = result_file_env
        self.limit = limit
        self.gates: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.env: dict[str, dict[str, str]] = {}
        self.added: Counter[str] = Counter()
        self.pods: dict[str, dict[str, Any]] = {}
        self.max_active = 0
        self.active_over: list[tuple[int, str]] = []
        self.events = 0
        self._plays: dict[str, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "FakeKubelet":
        self._watch = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_: object) -> None:
        tasks = [t for t in [self._watch, *self._plays.values()] if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def release(self, gate: str) -> None:
        self.gates[gate].set()

    def active(self) -> int:
        return sum(
            1
            for p in self.pods.values()
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )

    async def _run(self) -> None:
        while True:
            try:
                async for kind, pod in self.kube.watch(PODS, self.namespace, timeout_seconds=3600):
                    self._observe(kind, pod)
            except (KubeError, aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.1)

    def _observe(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        self.events += 1
        if kind == "DELETED":
            self.pods.pop(name, None)
            play = self._plays.pop(name, None)
            if play is not None:
                play.cancel()
        else:
            first = name not in self.pods and name not in self._plays
            self.pods[name] = pod
            if kind == "ADDED" and first:
                self.added[name] += 1
                self._plays[name] = asyncio.create_task(self._play(pod))
        active = self.active()
        self.max_active = max(self.max_active, active)
        if self.limit is not None and active > self.limit:
            self.active_over.append((active, name))

    # -- playing one pod ----------------------------------------------------------------------------

    async def _status(self, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(NotFound):
            await self.kube.patch(PODS, name, {"status": status}, self.namespace, subresource="status")

    async def _resolve(
        self, pod: Mapping[str, Any], container: Mapping[str, Any]
    ) -> tuple[dict[str, str], str | None]:
        """The container's env as the kubelet would start it, or why it cannot start."""
        env: dict[str, str] = {}
        for e in container.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is not None:
                try:
                    secret = await self.kube.get(SECRETS, ref["name"], self.namespace)
                except NotFound:
                    return env, f'secret "{ref["name"]}" not found'
                data = secret.get("data") or {}
                if ref["key"] in data:
                    env[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
                elif ref["key"] in (secret.get("stringData") or {}):
                    env[e["name"]] = secret["stringData"][ref["key"]]
                else:
                    return env, f"couldn't find key {ref['key']} in Secret {self.namespace}/{ref['name']}"
                continue
            value = str(e.get("value") or "")
            for name, resolved in env.items():
                value = value.replace(f"$({name})", resolved)
            env[e["name"]] = value
        for volume in pod["spec"].get("volumes") or []:
            cm = volume.get("configMap")
            if cm is None:
                continue
            try:
                obj = await self.kube.get(CONFIGMAPS, cm["name"], self.namespace)
            except NotFound:
                return env, f'configmap "{cm["name"]}" not found'
            for item in cm.get("items") or []:
                if item["key"] not in (obj.get("data") or {}):
                    return env, f"configmap {cm['name']} has no key {item['key']}"
        return env, None

    async def _play(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        spec = pod["spec"]
        inits = spec.get("initContainers") or []
        container = inits[0] if inits else spec["containers"][0]
        grader = spec["containers"][0] if inits else None
        env, problem = await self._resolve(pod, container)
        self.env[name] = env
        try:
            script = json.loads(env.get(self.task_env) or "{}").get("kubelet") or {}
        except (ValueError, AttributeError):
            script = {}
        do = script.get("do", "succeed")
        play = _Play(name, container, "initContainerStatuses" if inits else "containerStatuses")
        if grader is not None:
            waiting = {"waiting": {"reason": "PodInitializing"}}
            play.initializing = {
                "containerStatuses": [{"name": grader["name"], "ready": False, "state": waiting}]
            }
        if do == "unschedulable":
            await self._status(name, {"phase": "Pending", "conditions": [_unschedulable()]})
            return
        if problem is not None or do == "image-pull":
            await self._wait_forever(play, problem)
            return
        began = asyncio.get_running_loop().time()
        await self._start(play, pending=bool(inits))
        deadline = spec.get("activeDeadlineSeconds")
        deadline = None if deadline is None else float(deadline)
        if not await self._run_for(script, deadline):
            await self._fail(
                play, "DeadlineExceeded", "Pod was active on the node longer than the specified deadline"
            )
            return
        if do in ("delete", "evict", "oom"):
            await self._end_abnormally(play, do)
            return
        code = int(script.get("code", 0 if do == "succeed" else 1))
        written = script.get("message")
        if written is None and do == "succeed":
            written = json.dumps(script.get("result", {"reward": 1.0}))
        files: dict[tuple[str, str], str] = {}
        message = self._write_result(container, env, str(written or ""), files)
        term = self._terminated(
            play.cname, play.started, code, "Completed" if code == 0 else "Error", message
        )
        if grader is None or code != 0:
            phase = "Succeeded" if code == 0 else "Failed"
            await self._status(name, {"phase": phase, play.statuses: [term], **play.initializing})
            return
        left = None if deadline is None else deadline - (asyncio.get_running_loop().time() - began)
        await self._grade(pod, grader, term, script.get("grader") or {}, files, left)

    async def _wait_forever(self, play: "_Play", problem: str | None) -> None:
        """A container that cannot start: its env cannot be resolved, or its image cannot be pulled."""
        reason = "CreateContainerConfigError" if problem is not None else "ErrImagePull"
        message = problem or f'failed to pull image "{play.container["image"]}": not found'
        for why in [reason] if problem is not None else [reason, "ImagePullBackOff"]:
            waiting = {
                "name": play.cname,
                "ready": False,
                "state": {"waiting": {"reason": why, "message": message}},
            }
            await self._status(
                play.name,
                {
                    "phase": "Pending",
                    "conditions": _scheduled(),
                    play.statuses: [waiting],
                    **play.initializing,
                },
            )

    async def _start(self, play: "_Play", *, pending: bool) -> None:
        running = {"name": play.cname, **_IMAGE, "ready": True, "restartCount": 0}
        await self._status(
            play.name,
            {
                "phase": "Pending" if pending else "Running",
                "startTime": play.started,
                "conditions": _scheduled(),
                play.statuses: [{**running, "state": {"running": {"startedAt": play.started}}}],
                **play.initializing,
            },
        )

    async def _fail(self, play: "_Play", reason: str, message: str) -> None:
        term = self._terminated(play.cname, play.started, 137, "Error", "")
        await self._status(
            play.name, {"phase": "Failed", "reason": reason, "message": message, play.statuses: [term]}
        )

    async def _end_abnormally(self, play: "_Play", do: str) -> None:
        """The pod is deleted while it runs, evicted, or its container OOMKilled."""
        if do == "delete":
            with contextlib.suppress(NotFound):
                await self.kube.delete(PODS, play.name, self.namespace)
        elif do == "evict":
            await self._fail(play, "Evicted", "The node was low on resource: memory.")
        else:
            term = self._terminated(play.cname, play.started, 137, "OOMKilled", "")
            await self._status(play.name, {"phase": "Failed", play.statuses: [term]})

    async def _grade(
        self,
        pod: dict[str, Any],
        grader: Mapping[str, Any],
        harness: dict[str, Any],
        script: Mapping[str, Any],
        files: dict[tuple[str, str], str],
        deadline: float | None,
    ) -> None:
        """The pod's container after its init container (the harness) exited 0: the grader."""
        name, gname = pod["metadata"]["name"], grader["name"]
        env, _ = await self._resolve(pod, grader)
        self.env[f"{name}/{gname}"] = env
        started = _now()
        running = {"name": gname, **_IMAGE, "ready": True, "restartCount": 0}
        await self._status(
            name,
            {
                "phase": "Running",
                "initContainerStatuses": [harness],
                "containerStatuses": [{**running, "state": {"running": {"startedAt": started}}}],
            },
        )
        if not await self._run_for(script, deadline):
            term = self._terminated(gname, started, 137, "Error", "")
            status = {"phase": "Failed", "reason": "DeadlineExceeded", "message": "past the deadline"}
            await self._status(
                name, {**status, "initContainerStatuses": [harness], "containerStatuses": [term]}
            )
            return
        do = script.get("do", "succeed")
        if do == "oom":
            term = self._terminated(gname, started, 137, "OOMKilled", "")
            await self._status(
                name, {"phase": "Failed", "initContainerStatuses": [harness], "containerStatuses": [term]}
            )
            return
        code = int(script.get("code", 1 if do == "exit" else 0))
        written = script.get("message")
        if do == "echo":
            written = self._read_file(grader, env.get("INHARNESS_HARNESS_RESULT_FILE", ""), files)
        elif written is None and do == "succeed":
            written = json.dumps(script.get("result", {"reward": 1.0}))
        message = self._write_result(grader, env, str(written or ""), files)
        term = self._terminated(gname, started, code, "Completed" if code == 0 else "Error", message)
        await self._status(
            name,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "initContainerStatuses": [harness],
                "containerStatuses": [term],
            },
        )

    def _write_result(
        self,
        container: Mapping[str, Any],
        env: Mapping[str, str],
        written: str,
        files: dict[tuple[str, str], str],
    ) -> str:
        """Where what the container wrote to its result file ends up: the termination message (the
        return value) when the file is the termination message path, else a file of a mounted emptyDir."""
        target = env.get(self.result_file_env, "")
        if target == container.get("terminationMessagePath", "/dev/termination-log"):
            return written[:MESSAGE_LIMIT]
        where = _in_mount(container, target)
        if where is not None:
            files[where] = written
        return ""

    @staticmethod
    def _read_file(container: Mapping[str, Any], path: str, files: Mapping[tuple[str, str], str]) -> str:
        where = _in_mount(container, path)
        return files.get(where, "") if where is not None else ""

    async def _run_for(self, script: Mapping[str, Any], deadline: float | None) -> bool:
        """Let the "harness" run; False when the pod's active deadline passed first."""
        work = {asyncio.create_task(asyncio.sleep(float(script.get("seconds", 0))))}
        if script.get("hold"):
            work.add(asyncio.create_task(self.gates[str(script["hold"])].wait()))
        try:
            _, pending = await asyncio.wait(work, timeout=deadline)
            return not pending
        finally:
            for task in work:
                task.cancel()

    @staticmethod
    def _terminated(name: str, started: str, code: int, reason: str, message: str) -> dict[str, Any]:
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started,
            "finishedAt": _now(),
        }
        if message:
            term["message"] = message
        return {"name": name, **_IMAGE, "ready": False, "restartCount": 0, "state": {"terminated": term}}


def _in_mount(container: Mapping[str, Any], path: str) -> tuple[str, str] | None:
    """(volume, path inside it) of a file path under one of the container's volume mounts."""
    for mount in container.get("volumeMounts") or []:
        root = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(root):
            return mount["name"], path.removeprefix(root)
    return None


@dataclass
class _Play:
    """One pod being played: its name, the container that runs first and where its status goes."""

    name: str
    container: Mapping[str, Any]
    statuses: str  # "initContainerStatuses" (a graded pod's harness) or "containerStatuses"
    initializing: dict[str, Any] = field(default_factory=dict)  # the grader's status while it waits
    started: str = field(default_factory=lambda: _now())

    @property
    def cname(self) -> str:
        return str(self.container["name"])


def _scheduled() -> list[dict[str, Any]]:
    return [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()}]


def _unschedulable() -> dict[str, Any]:
    return {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient memory.",
        "lastTransitionTime": _now(),
    }


JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")


class FakeJobController:
    """See the module docstring. Use as `async with FakeJobController(kube, namespace) as jobs:`."""

    def __init__(self, kube: KubeClient, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.created: Counter[str] = Counter()  # pods made, by Job
        self.collected: list[str] = []  # pods deleted because their Job was
        self.requests = 0  # what this fake sent the API server (the job controller's share of the load)
        self._pods: dict[str, str] = {}  # Job -> its pod
        self._jobs: dict[str, dict[str, Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> "FakeJobController":
        self._tasks = [asyncio.create_task(self._run(JOBS)), asyncio.create_task(self._run(PODS))]
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, resource: Any) -> None:
        while True:
            try:
                async for kind, obj in self.kube.watch(resource, self.namespace, timeout_seconds=3600):
                    if resource is JOBS:
                        await self._on_job(kind, obj)
                    else:
                        await self._on_pod(kind, obj)
            except (KubeError, aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.1)

    async def _on_job(self, kind: str, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        if kind == "DELETED":
            self._jobs.pop(name, None)
            pod = self._pods.pop(name, None)
            if pod is not None:
                self.collected.append(pod)
                self.requests += 1
                with contextlib.suppress(NotFound):
                    await self.kube.delete(PODS, pod, self.namespace)
            return
        self._jobs[name] = job
        if name in self._pods or (job.get("spec") or {}).get("suspend") or _job_finished(job):
            return
        await self._make_pod(job)

    async def _make_pod(self, job: dict[str, Any]) -> None:
        meta, template = job["metadata"], job["spec"]["template"]
        name = f"{meta['name']}-{uuid.uuid4().hex[:5]}"
        self._pods[meta["name"]] = name
        self.created[meta["name"]] += 1
        labels = {
            **(template.get("metadata") or {}).get("labels", {}),
            **dict.fromkeys(JOB_NAME_LABELS, meta["name"]),
        }
        owner = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": meta["name"],
            "uid": meta.get("uid", ""),
            "controller": True,
            "blockOwnerDeletion": True,
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "ownerReferences": [owner],
            },
            "spec": template["spec"],
        }
        self.requests += 2
        await self.kube.create(PODS, pod, self.namespace)
        await self._status(meta["name"], {"startTime": _now(), "active": 1})

    async def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        job_name = ((pod.get("metadata") or {}).get("labels") or {}).get("job-name")
        job = self._jobs.get(job_name or "")
        if job is None or _job_finished(job) or self._pods.get(job_name or "") != pod["metadata"]["name"]:
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase == "Succeeded":
            await self._finish(
                job, "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
            )
        elif phase == "Failed" or kind == "DELETED":
            await self._finish(job, "Failed", *_failure(pod, deleted=kind == "DELETED"))

    async def _finish(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        condition = {"type": type_, "status": "True", "reason": reason, "message": message}
        counts = {"succeeded": 1} if type_ == "Complete" else {"failed": 1}
        job["status"] = {**(job.get("status") or {}), "conditions": [condition]}  # until its event comes
        await self._status(job["metadata"]["name"], {"active": 0, **counts, "conditions": [condition]})

    async def _status(self, name: str, status: dict[str, Any]) -> None:
        self.requests += 1
        with contextlib.suppress(NotFound):
            await self.kube.patch(JOBS, name, {"status": status}, self.namespace, subresource="status")


def _job_finished(job: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def _failure(pod: Mapping[str, Any], *, deleted: bool) -> tuple[str, str]:
    """(reason, message) of a Job whose one pod failed, as the job controller words them."""
    status = pod.get("status") or {}
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        code = ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")
        if code not in (None, 0) and not deleted:
            where = f"{pod['metadata'].get('namespace')}/{pod['metadata']['name']}"
            return (
                "PodFailurePolicy",
                f"Container {cs['name']} for pod {where} failed with exit code {code} "
                "matching FailJob rule at index 1",
            )
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
