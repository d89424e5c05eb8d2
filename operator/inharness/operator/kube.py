"""The Kubernetes API client our own code uses (kopf keeps its own for watching and handlers).

Async, on aiohttp; credentials from the in-cluster service account, else the current context of
KUBECONFIG (or ~/.kube/config). Requests are paced by a client-side token bucket (`qps`, `burst`)
so a burst of work cannot flood the API server, and counted per verb (`requests`), which is how
the benchmarks count API requests per attempt. Errors come back as `KubeError` with the API
server's status, reason and message; 404 is `NotFound`, 409 on create `AlreadyExists`, other 409s
`Conflict`.
"""

import asyncio
import base64
import json
import os
import ssl
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from inharness.operator.api import GROUP, HARNESSSPEC, ROLLOUTPOOL, TRAININGRUN, VERSION

Obj = dict[str, Any]

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
            if subresource is not None:
                base += f"/{subresource}"
        return base


PODS = Resource("", "v1", "pods")
SECRETS = Resource("", "v1", "secrets")
CONFIGMAPS = Resource("", "v1", "configmaps")
SERVICES = Resource("", "v1", "services")
PERSISTENTVOLUMECLAIMS = Resource("", "v1", "persistentvolumeclaims")
EVENTS = Resource("", "v1", "events")
DEPLOYMENTS = Resource("apps", "v1", "deployments")
STATEFULSETS = Resource("apps", "v1", "statefulsets")
TRAININGRUNS = Resource(GROUP, VERSION, TRAININGRUN.plural)
ROLLOUTPOOLS = Resource(GROUP, VERSION, ROLLOUTPOOL.plural)
HARNESSSPECS = Resource(GROUP, VERSION, HARNESSSPEC.plural)


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


class AlreadyExists(KubeError):
    pass


class _TokenBucket:
    """`qps` requests per second on average, up to `burst` at once."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, burst
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self) -> None:
        async with self._lock:
            while True:
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._at) * self.qps)
                self._at = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.qps)


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str | None = None
    token_file: Path | None = None  # re-read: bound service-account tokens rotate
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False


class KubeClient:
    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        *,
        credentials: Credentials | None = None,
        qps: float = 50.0,
        burst: int = 100,
        timeout: float = 30.0,
    ) -> None:
        if credentials is None:
            if server is None:
                raise ValueError("KubeClient needs a server URL or credentials")
            credentials = Credentials(server=server, token=token)
        self.credentials = credentials
        self.server = credentials.server.rstrip("/")
        self.requests: Counter[str] = Counter()
        self._bucket = _TokenBucket(qps, burst)
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))
        self._session: aiohttp.ClientSession | None = None
        self._token: tuple[float, str | None] = (0.0, credentials.token)

    @classmethod
    def from_environment(cls, **kwargs: Any) -> "KubeClient":
        """In a pod: its service account. Elsewhere: KUBECONFIG's (or ~/.kube/config's) current context."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if host and port and (SERVICE_ACCOUNT / "token").exists():
            server = f"https://{f'[{host}]' if ':' in host else host}:{port}"
            return cls(
                credentials=Credentials(
                    server=server,
                    token_file=SERVICE_ACCOUNT / "token",
                    ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
                ),
                **kwargs,
            )
        return cls(credentials=_from_kubeconfig(), **kwargs)

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- requests ------------------------------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext | bool:
        c = self.credentials
        if not self.server.startswith("https"):
            return False
        if c.insecure:
            return False
        context = ssl.create_default_context(cafile=c.ca_file)
        if c.cert_file:
            context.load_cert_chain(c.cert_file, c.key_file)
        return context

    def _session_for_loop(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=64)
            )
        return self._session

    def _bearer(self) -> str | None:
        c = self.credentials
        if c.token_file is None:
            return c.token
        read_at, token = self._token
        if time.monotonic() - read_at > 60 or token is None:
            token = c.token_file.read_text().strip()
            self._token = (time.monotonic(), token)
        return token

    async def _request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        await self._bucket.take()
        self.requests[verb] += 1
        headers = {"Accept": "application/json"}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), content_type
        async with self._session_for_loop().request(
            method, self.server + path, params=params, data=data, headers=headers
        ) as r:
            text = await r.text()
            if r.status >= 400:
                raise _error(r.status, text, creating=verb == "create")
            try:
                return json.loads(text) if text else {}
            except ValueError:
                raise KubeError(r.status, "InvalidResponse", f"not JSON: {text[:200]!r}") from None

    async def get(self, resource: Resource, name: str, namespace: str | None = None) -> Obj:
        return await self._request("get", "GET", resource.path(namespace, name))

    async def list_with_version(
        self, resource: Resource, namespace: str | None = None, *, label_selector: str | None = None
    ) -> tuple[list[Obj], str]:
        """`list` and the list's resourceVersion, the point a watch continues from without a gap."""
        items: list[Obj] = []
        version = ""
        params: dict[str, str] = {"limit": "500"}
        if label_selector:
            params["labelSelector"] = label_selector
        while True:
            page = await self._request("list", "GET", resource.path(namespace), params=params)
            kind = str(page.get("kind") or "").removesuffix("List")
            version = str((page.get("metadata") or {}).get("resourceVersion") or version)
            for item in page.get("items") or []:
                item.setdefault("apiVersion", resource.api_version)
                if kind:
                    item.setdefault("kind", kind)
                items.append(item)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items, version
            params["continue"] = token

    async def list(
        self, resource: Resource, namespace: str | None = None, *, label_selector: str | None = None
    ) -> list[Obj]:
        """Every object (all pages), each with its apiVersion and kind as a single GET would give."""
        items, _ = await self.list_with_version(resource, namespace, label_selector=label_selector)
        return items

    async def create(self, resource: Resource, obj: Mapping[str, Any], namespace: str | None = None) -> Obj:
        return await self._request("create", "POST", resource.path(namespace), body=obj)

    async def patch(
        self,
        resource: Resource,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Obj:
        """A JSON merge patch (RFC 7386): nested maps merge, lists are replaced, null deletes."""
        return await self._request(
            "patch",
            "PATCH",
            resource.path(namespace, name, subresource),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, resource: Resource, name: str, namespace: str | None = None) -> Obj:
        return await self._request(
            "delete", "DELETE", resource.path(namespace, name), body={"propagationPolicy": "Background"}
        )

    async def watch(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        resource_version: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, Obj]]:
        """(type, object) per watch event until the server ends the stream; ERROR events raise."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            params["labelSelector"] = label_selector
        if resource_version:
            params["resourceVersion"] = resource_version
        await self._bucket.take()
        self.requests["watch"] += 1
        headers = {"Accept": "application/json"}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        session = self._session_for_loop()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        async with session.get(
            self.server + resource.path(namespace), params=params, headers=headers, timeout=timeout
        ) as r:
            if r.status >= 400:
                raise _error(r.status, await r.text())
            async for line in r.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise _error(int(status.get("code") or 500), json.dumps(status))
                yield event["type"], event["object"]


def _error(status: int, text: str, *, creating: bool = False) -> KubeError:
    try:
        body = json.loads(text)
        reason, message = str(body.get("reason") or ""), str(body.get("message") or text)
    except (ValueError, AttributeError):
        reason, message = "", text
    if status == 404:
        return NotFound(status, reason or "NotFound", message)
    if status == 409:
        if creating or reason == "AlreadyExists":
            return AlreadyExists(status, reason or "AlreadyExists", message)
        return Conflict(status, reason or "Conflict", message)
    return KubeError(status, reason or "Error", message)


def _from_kubeconfig() -> Credentials:
    paths = [p for p in (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if p]
    merged: dict[str, dict[str, Any]] = {"contexts": {}, "clusters": {}, "users": {}}
    current: str | None = None
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            continue
        config = yaml.safe_load(path.read_text()) or {}
        current = current or config.get("current-context")
        for section in merged:
            for item in config.get(section) or []:
                merged[section].setdefault(item["name"], item.get(section.removesuffix("s")) or {})
    if current is None or current not in merged["contexts"]:
        raise KubeError(
            0, "NoCredentials", "no in-cluster service account and no current context in KUBECONFIG"
        )
    context = merged["contexts"][current]
    cluster = merged["clusters"].get(context.get("cluster"), {})
    user = merged["users"].get(context.get("user"), {})
    return Credentials(
        server=cluster["server"],
        token=user.get("token"),
        ca_file=cluster.get("certificate-authority") or _data_file(cluster.get("certificate-authority-data")),
        cert_file=user.get("client-certificate") or _data_file(user.get("client-certificate-data")),
        key_file=user.get("client-key") or _data_file(user.get("client-key-data")),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


def _data_file(data: str | None) -> str | None:
    """Inline base64 PEM from a kubeconfig, as a file: ssl loads certificates from paths."""
    if not data:
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".pem", delete=False) as f:
        f.write(base64.b64decode(data))
    return f.name
