"""The Kubernetes API client our own code uses (kopf keeps its own for watching and handlers).

Async, on aiohttp. Credentials come from the `kubernetes` package's loaders (`login_from_environment`),
the ones kopf's own login uses when that package is installed: the in-cluster service account, else
the current context of KUBECONFIG with whatever user kubectl would take, exec plugins and OIDC
included. Only the loaders: that package's API client is synchronous (urllib3), so the transport
stays ours. A login runs in a thread (an exec plugin is a subprocess), at the first request; the
loaders' own refresh hook is asked every `renew_seconds` whether a token is due (an exec token 5
minutes before its expirationTimestamp, a rotating service-account token after a minute); a 401 logs
in afresh once (the plugin runs again) and sends the request again.

Requests are paced by a client-side token bucket (`qps`, `burst`) so a burst of work cannot flood
the API server, and counted per verb (`requests`, a request sent again after a 401 included), which
is how the benchmarks count API requests per attempt. Errors come back as `KubeError` with the API
server's status, reason and message; 404 is `NotFound`, 409 on create `AlreadyExists`, other 409s
`Conflict`; credentials that cannot be loaded are `KubeError`s with status 0.
"""

import asyncio
import contextlib
import functools
import json
import logging
import os
import ssl
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes.client import Configuration
from kubernetes.config import ConfigException, load_incluster_config
from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

from inharness.operator.api import GROUP, HARNESSSPEC, ROLLOUTPOOL, TRAININGRUN, VERSION

Obj = dict[str, Any]


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
JOBS = Resource("batch", "v1", "jobs")
NETWORKPOLICIES = Resource("networking.k8s.io", "v1", "networkpolicies")
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
    """Where the API server is, how to trust it and who we are: what one login gives."""

    server: str
    authorization: str | None = None  # the Authorization header: "Bearer …" (or "Basic …")
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    # Blocking (it may run an exec plugin): these credentials now, a token that is due renewed by the
    # loader's own rule. None: they never change (a server URL and a token given to KubeClient).
    renew: "Callable[[], Credentials] | None" = field(default=None, compare=False, repr=False)


Login = Callable[[], Credentials]
"""Blocking (it may run an exec plugin): called in a thread, at the first request and after a 401."""


class KubeClient:
    def __init__(
        self,
        server: str | None = None,
        token: str | None = None,
        *,
        login: Login | None = None,
        qps: float = 50.0,
        burst: int = 100,
        timeout: float = 30.0,
        renew_seconds: float = 30.0,
    ) -> None:
        """`server` (and `token`) for fixed credentials, or `login` for ones that are loaded and renewed."""
        if (server is None) == (login is None):
            raise ValueError("KubeClient takes a server URL or a login, one of them")
        self.credentials: Credentials | None = None  # until the first request logs in
        if server is not None:
            self.credentials = Credentials(server.rstrip("/"), f"Bearer {token}" if token else None)
        self.requests: Counter[str] = Counter()
        self._login = login
        self._renew_seconds = renew_seconds
        self._renewed_at = time.monotonic()
        self._auth_lock = asyncio.Lock()
        self._ssl: tuple[tuple[object, ...], ssl.SSLContext | bool] | None = None  # for the last credentials
        self._bucket = _TokenBucket(qps, burst)
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 10.0))
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, **kwargs: Any) -> "KubeClient":
        """In a pod: its service account. Elsewhere: KUBECONFIG's (or ~/.kube/config's) current context.
        Nothing is loaded before the first request (see `login_from_environment`)."""
        return cls(login=login_from_environment, **kwargs)

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- credentials ---------------------------------------------------------------------------

    async def _credentials(self) -> Credentials:
        """The credentials to send now: logged in at the first request, renewed every `renew_seconds`."""
        c = self.credentials
        if c is not None and (c.renew is None or time.monotonic() - self._renewed_at < self._renew_seconds):
            return c
        async with self._auth_lock:
            if self.credentials is c:  # else another request logged in or renewed while this one waited
                load = self._login if c is None else c.renew
                assert load is not None
                self.credentials = await asyncio.to_thread(load)
                self._renewed_at = time.monotonic()
            assert self.credentials is not None
            return self.credentials

    async def _unauthorized(self, sent: Credentials) -> bool:
        """After a 401 on `sent`: log in afresh (the exec plugin runs again, token files are re-read), once
        for all the requests that were sent with them. False when there is no login to do it with."""
        if self._login is None:
            return False
        async with self._auth_lock:
            if self.credentials is sent:
                self.credentials = await asyncio.to_thread(self._login)
                self._renewed_at = time.monotonic()
        return True

    def _ssl_for(self, c: Credentials) -> ssl.SSLContext | bool:
        key = (c.server, c.ca_file, c.cert_file, c.key_file, c.insecure)
        if self._ssl is None or self._ssl[0] != key:
            context: ssl.SSLContext | bool = False
            if not c.insecure and c.server.startswith("https"):
                context = ssl.create_default_context(cafile=c.ca_file)
                if c.cert_file:
                    context.load_cert_chain(c.cert_file, c.key_file)
            self._ssl = (key, context)
        return self._ssl[1]

    # -- requests ------------------------------------------------------------------------------

    def _session_for_loop(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=64)
            )
        return self._session

    @contextlib.asynccontextmanager
    async def _send(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        client_timeout: aiohttp.ClientTimeout | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, paced and counted; after a 401, a fresh login and the request once more."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), content_type
        for attempt in range(2):
            await self._bucket.take()
            self.requests[verb] += 1
            c = await self._credentials()
            authorization = {"Authorization": c.authorization} if c.authorization else {}
            async with self._session_for_loop().request(
                method,
                c.server + path,
                params=params,
                data=data,
                headers=headers | authorization,
                ssl=self._ssl_for(c),
                server_hostname=c.tls_server_name,
                timeout=client_timeout or self._timeout,
            ) as r:
                if r.status == 401 and attempt == 0 and await self._unauthorized(c):
                    continue
                yield r
                return

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
        async with self._send(verb, method, path, params=params, body=body, content_type=content_type) as r:
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
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        async with self._send(
            "watch", "GET", resource.path(namespace), params=params, client_timeout=timeout
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


def login_from_environment() -> Credentials:
    """The `kubernetes` package's loaders, the ones kopf's own login uses: in a pod, its service account
    (the token file is re-read every minute: bound tokens rotate); elsewhere, KUBECONFIG's (or
    ~/.kube/config's) current context with any user kubectl takes: a token or token file, a client
    certificate, an exec plugin (`aws eks get-token`, `gke-gcloud-auth-plugin`, `kubelogin`), an OIDC or
    GCP auth provider (a refreshed token is written back to the kubeconfig, as kubectl does)."""
    configuration = Configuration()
    try:
        load_incluster_config(client_configuration=configuration)
    except ConfigException as not_in_pod:
        _load_kubeconfig(configuration, not_in_pod)
    return _credentials(configuration)


def _load_kubeconfig(configuration: Configuration, not_in_pod: ConfigException) -> None:
    # Read at each login: the package's own default is KUBECONFIG as it was when the package was imported.
    paths = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        merged = KubeConfigMerger(paths)
        if merged.config is None:
            raise ConfigException(f"no kubeconfig at {paths}")
        loader = KubeConfigLoader(merged.config, config_base_path=None, config_persister=merged.save_changes)
        with _LoaderErrors() as errors:
            loader.load_and_set(configuration)
    except ConfigException as e:
        raise KubeError(
            0, "NoCredentials", f"not in a pod ({not_in_pod}) and, from KUBECONFIG: {e}"
        ) from None
    user_name = loader.current_context["context"].get("user")
    user = merged.config["users"].get_with_name(user_name, safe=True) if user_name else None
    plugin = ((user.value.get("user") if user else None) or {}).get("exec")
    if plugin and not (configuration.api_key.get("BearerToken") or configuration.cert_file):
        reasons = "; ".join(errors.messages) or "its error was not logged"
        raise KubeError(
            0,
            "ExecPluginFailed",
            f"the exec credential plugin {plugin.get('command')!r} of user {user_name!r} gave no credential: "
            + reasons,
        )


def _credentials(configuration: Configuration) -> Credentials:
    """What a loaded Configuration holds now."""
    authorization = configuration.api_key.get("BearerToken")
    return Credentials(
        server=configuration.host.rstrip("/"),
        authorization=authorization.strip() if authorization else None,
        ca_file=configuration.ssl_ca_cert,
        cert_file=configuration.cert_file,
        key_file=configuration.key_file,
        insecure=not configuration.verify_ssl,
        tls_server_name=configuration.tls_server_name,
        renew=functools.partial(_renewed, configuration),
    )


def _renewed(configuration: Configuration) -> Credentials:
    """After the loader's refresh hook, which renews only what is due: an exec plugin runs again when
    its token is within 5 minutes of its expirationTimestamp (OIDC and GCP tokens likewise), the
    service-account token file is re-read when it was read over a minute ago."""
    if configuration.refresh_api_key_hook is not None:
        try:
            configuration.refresh_api_key_hook(configuration)
        except (ConfigException, OSError) as e:
            raise KubeError(0, "NoCredentials", str(e)) from None
    return _credentials(configuration)


class _LoaderErrors(logging.Handler):
    """Why an exec plugin gave nothing: the kubeconfig loader logs the reason (its exit status and stderr)
    and carries on without a credential. Collected from this thread only, while a login runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread and record.module == "kube_config":
            self.messages.append(record.getMessage())

    def __enter__(self) -> "_LoaderErrors":
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        logging.getLogger().removeHandler(self)
