"""The gateway's FastAPI application: wiring of store, engines, prompts, serving gate and routes."""

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import aiohttp
from fastapi import Depends, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from inharness.gateway import control
from inharness.gateway.calls import CallService
from inharness.gateway.engines import EnginePool
from inharness.gateway.errors import (
    APIError,
    api_error_handler,
    error_response,
    http_error_handler,
    validation_error_handler,
)
from inharness.gateway.metrics import GatewayMetrics
from inharness.gateway.prompts import PromptBuilder
from inharness.gateway.protocols import anthropic_messages, harness_api, openai_chat, openai_responses
from inharness.gateway.serving import POLL_SECONDS, ServingGate, worker_report
from inharness.gateway.settings import GatewaySettings
from inharness.gateway.store import Store

log = logging.getLogger("inharness.gateway")


def _load_tokenizer(model_dir: str) -> tuple[Any, int, list[int]]:
    """Tokenizer, context length and stop token ids of the model the gateway serves."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not tok.chat_template:
        raise ValueError(
            f"{model_dir}: the tokenizer has no chat template; the gateway renders prompts with it"
        )
    config = AutoConfig.from_pretrained(model_dir)
    max_len = int(getattr(config, "max_position_embeddings", 0) or tok.model_max_length)
    stops: set[int] = set()
    if tok.eos_token_id is not None:
        stops.add(int(tok.eos_token_id))
    if (Path(model_dir) / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        stops.update([eos] if isinstance(eos, int) else list(eos or []))
    return tok, max_len, sorted(stops)


async def _open_calls(settings: GatewaySettings, session: aiohttp.ClientSession) -> CallService:
    """The call path with its store, engine pool, serving gate and metrics; the engines of the
    initial version registered (active unless another version already is) and checked once."""
    tokenizer, model_len, stops = _load_tokenizer(settings.model)
    store = await Store.open(
        settings.store, sqlite_synchronous=settings.sqlite_synchronous, bodies=settings.bodies
    )
    pool = EnginePool(session, retries=settings.engine_retries, api_key=settings.engine_api_key())
    if settings.engines:
        has_active = any(v.active for v in await store.list_versions())
        await store.register_version(settings.model_version, settings.engines, activate=not has_active)
    for v in await store.list_versions():
        pool.set_version(v.version, v.engines)
        if v.active:
            pool.activate(v.version)
    await asyncio.gather(*(pool.check(e) for e in pool.engines()))
    metrics = GatewayMetrics()
    gate = ServingGate(default_hold_seconds=settings.hold_seconds)
    metrics.in_flight.set_function(lambda: gate.in_flight)
    metrics.held.set_function(lambda: gate.held)
    shared = await store.serving()  # a pause still holding when this process starts holds here too
    gate.generation = shared.generation
    if shared.holding(time.time()):
        gate.hold_until(shared.resumes_at or time.time())
    return CallService(
        store=store,
        pool=pool,
        prompts=PromptBuilder(tokenizer, store),
        tokenizer=tokenizer,
        gate=gate,
        metrics=metrics,
        max_model_len=settings.max_model_len or model_len,
        stop_token_ids=stops,
        temperature=settings.temperature,
        max_tokens=settings.max_tokens,
    )


def create_app(settings: GatewaySettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.engine_timeout_seconds, sock_connect=5.0),
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60),
        )
        try:
            calls = await _open_calls(settings, session)
        except BaseException:
            await session.close()
            raise
        app.state.store, app.state.calls = calls.store, calls
        tasks = [
            asyncio.create_task(calls.pool.health_forever(), name="engine-health"),
            asyncio.create_task(
                _sweep_leases(calls.store, calls.metrics, settings.lease_sweep_seconds), name="lease-sweeper"
            ),
        ]
        if calls.store.shared:
            tasks.append(
                asyncio.create_task(_follow_store(calls, app.state.worker_id), name="store-follower")
            )
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            if calls.store.shared:
                with contextlib.suppress(Exception):
                    await calls.store.forget_worker(app.state.worker_id)
            await calls.store.close()

    app = FastAPI(
        title="inharness gateway",
        version="v1alpha1",
        summary="OpenAI-compatible recording proxy and control API for RL in unmodified agent harnesses",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.admin_token_digest = hashlib.sha256(settings.admin_token.encode()).digest()
    app.state.worker_id = f"{os.getpid()}-{secrets.token_hex(8)}"
    app.state.served_model_name = settings.served_model_name or Path(settings.model).name
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    routers = (openai_chat.router, openai_responses.router, anthropic_messages.router, harness_api.router)
    for router in routers:
        app.include_router(router)
        app.include_router(router, prefix="/t/{token}", dependencies=[Depends(_key_in_path)])
    app.include_router(control.router)

    app.add_exception_handler(Exception, _server_error)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        m: GatewayMetrics = request.app.state.calls.metrics
        m.queue_depth.set(await request.app.state.store.count_rollouts("queued"))
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _server_error(_req: Request, _exc: Exception) -> Response:
    """A 500 outside any route class (those answer theirs in their protocol's format)."""
    return error_response(500, "the gateway failed to answer this request; its log says why")


_ERROR_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}
_ERRORS = {
    "400": "the request is invalid (a bad body is 400, never 422)",
    "401": "no valid key: the attempt's key on harness routes, the admin token on /api/v1",
    "413": "the body exceeds --max-request-bytes",
    "default": "any other error, in the same format",
}


def _key_in_path(
    token: Annotated[
        str,
        PathParam(
            min_length=1,
            max_length=256,  # keys are `ih-` and 32 characters; a longer one is no key (401)
            description="the attempt's key, for a harness that takes a base URL but no API key",
        ),
    ],
) -> None:
    """Declares the `/t/{token}` prefix's parameter, so that the OpenAPI document names it (a client
    generator or a fuzzer refuses a path parameter it does not know); `attempt_key` reads it."""


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with the gateway's errors as it answers them: a body that fails validation
    is a 400 (FastAPI would promise 422), every error in its protocol's format (Anthropic's on
    /v1/messages routes, OpenAI's elsewhere)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(_ERROR_SCHEMAS)
    for path, operations in doc["paths"].items():
        for op in operations.values():
            op.get("responses", {}).pop("422", None)
        if path in ("/healthz", "/metrics") or path.endswith("/v1/models"):  # no key, no body
            continue
        ref = "AnthropicError" if "/v1/messages" in path else "Error"
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}
        for op in operations.values():
            responses = op.setdefault("responses", {})
            for status, what in _ERRORS.items():
                responses.setdefault(status, {"description": what, "content": content})
    app.openapi_schema = doc
    return doc


async def _sweep_leases(store: Store, metrics: GatewayMetrics, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            expired = await store.expire_leases()
        except Exception:
            log.exception("lease sweep failed; retrying")
            continue
        if expired:
            metrics.leases_expired.inc(expired)


async def _follow_store(calls: CallService, worker_id: str) -> None:
    """Every POLL_SECONDS: report this process (the serving generation it applied, its calls) and apply
    what other processes on the store changed: a pause or resume, a model version registered or
    activated. A failed poll is logged and retried; the process keeps serving what it last applied."""
    store, gate, pool = calls.store, calls.gate, calls.pool
    while True:
        try:
            read_at = time.monotonic()
            shared, versions = await store.sync_worker(worker_report(gate, worker_id))
            if shared.generation > gate.generation:
                gate.apply(
                    holding=shared.holding(time.time()),
                    resumes_at=shared.resumes_at,
                    generation=shared.generation,
                )
            known = {e.url for e in pool.engines()}
            for v in versions:
                pool.set_version(v.version, v.engines)
            await asyncio.gather(*(pool.check(e) for e in pool.engines() if e.url not in known))
            active = next((v.version for v in versions if v.active), None)
            if active is not None and read_at > pool.active_set_at:  # not older than this process's own
                pool.active = active
        except Exception:
            log.exception("applying the store's shared state failed; retrying")
        await asyncio.sleep(POLL_SECONDS)


def serve(settings: GatewaySettings) -> int:
    """Run the gateway until stopped, as one process or `settings.workers` on one port; its exit code."""
    if settings.workers > 1:
        return _supervise(settings)
    _serve_one(settings, sock=None, ready=None)
    return 0


def _serve_one(settings: GatewaySettings, *, sock: socket.socket | None, ready: Any) -> None:
    """One gateway process: on its own socket (`sock`, a worker's) or binding host:port itself. A worker
    tells the supervisor it is up through `ready` instead of printing."""
    import uvicorn
    import uvloop

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http=_head_deadline_protocol(settings.request_head_timeout_seconds, settings.request_head_max_bytes),
    )
    server = uvicorn.Server(config)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn exposes no event)
            await asyncio.sleep(0.05)
        if server.started and ready is not None:
            ready.put(os.getpid())
        elif server.started:
            print(f"gateway ready on http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
        await task

    uvloop.run(run())


def _refusal(status: bytes, why: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, written to the transport as is: the head
    deadline answers before uvicorn has a request to answer through."""
    text = why.encode()
    return (
        b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, len(text), text)
    )


def _head_deadline_protocol(seconds: float, max_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a deadline and a size bound on each request's head (its line
    and headers).

    uvicorn bounds only the idle time between requests (its keep-alive timeout, which any byte
    cancels), and httptools buffers a head of any length for as long as it takes: a client that
    dribbles header bytes, or connects and sends nothing, held its connection and what it sent for
    ever. The deadline runs from the connection's start, from the first byte after a response, or from
    a pipelined request's first byte, to the head's end; a late head is answered 408 and its connection
    closed. Within the deadline a head still grew without bound (httptools keeps it all): one above
    `max_bytes` is answered 431 and its connection closed. The body has its own deadline
    (`--request-read-timeout-seconds`, `errors.BoundedRequest`) and size bound (413)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    answer = _refusal(
        b"408 Request Timeout", f"the request's line and headers did not arrive within {seconds:g} s"
    )
    too_large = _refusal(
        b"431 Request Header Fields Too Large",
        f"the request's line and headers are over {max_bytes} bytes",
    )

    class HeadDeadline(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # received since the head now due began

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request in flight: a head is due
                self._await_head()
            if self._head_timer is not None:
                self._head_bytes += len(data)
            super().data_received(data)
            # still due after this data (a head that ended in it reset the count): bound what it holds
            if self._head_timer is not None and self._head_bytes > max_bytes:
                self._refuse(too_large)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._await_head()  # also a pipelined request's, behind one in flight

        def on_headers_complete(self) -> None:
            self._head_arrived()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_arrived()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._head_late)
                self._head_bytes = 0

        def _head_arrived(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            self._refuse(answer)

        def _refuse(self, response: bytes) -> None:
            self._head_arrived()
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # never into a response under way
                self.transport.write(response)
            self.transport.close()

    return HeadDeadline


def _reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker(settings: GatewaySettings, parent: int, ready: Any) -> None:
    """A worker process: dies with its supervisor (PR_SET_PDEATHSIG), listens on its own SO_REUSEPORT
    socket, so the kernel spreads connections over the workers."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        return
    _serve_one(settings, sock=_reuseport_socket(settings.host, settings.port), ready=ready)


def _supervise(settings: GatewaySettings) -> int:
    """Start `settings.workers` gateway processes on one port and wait. A worker that exits stops the
    whole gateway (exit code 1), so that what runs it (Kubernetes, systemd) restarts it whole rather
    than this process hiding a crash loop; SIGTERM or SIGINT stops the workers and exits 0."""
    import multiprocessing
    import signal
    from multiprocessing.connection import wait

    # Holds the port (and picks one for --port 0): bound with SO_REUSEPORT, never listening, so every
    # connection goes to a worker's socket.
    holder = _reuseport_socket(settings.host, settings.port)
    port = holder.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    worker_settings = settings.model_copy(update={"port": port})
    procs = [
        ctx.Process(target=_worker, args=(worker_settings, os.getpid(), ready), name=f"gateway-worker-{i}")
        for i in range(settings.workers)
    ]
    signalled = False

    def stop() -> None:
        for p in procs:
            if p.is_alive():
                p.terminate()

    def on_signal(_signum: int, _frame: Any) -> None:
        nonlocal signalled
        signalled = True
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for p in procs:
        p.start()
    started = 0
    while started < len(procs) and not signalled and all(p.is_alive() for p in procs):
        with contextlib.suppress(Exception):
            ready.get(timeout=0.2)
            started += 1
    if started == len(procs):
        print(
            f"gateway ready on http://{settings.host}:{port} ({len(procs)} workers)",
            file=sys.stderr,
            flush=True,
        )
        wait([p.sentinel for p in procs])  # the first worker to exit, or a signal's stop
    stop()
    for p in procs:
        p.join()
    holder.close()
    return 0 if signalled else 1
