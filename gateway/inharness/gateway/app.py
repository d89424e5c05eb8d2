"""The gateway's FastAPI application: wiring of store, engines, prompts, serving gate and routes."""

import asyncio
import contextlib
import hashlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
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
from inharness.gateway.progress import ProgressBoard
from inharness.gateway.prompts import PromptBuilder
from inharness.gateway.protocols import anthropic_messages, harness_api, openai_chat, openai_responses
from inharness.gateway.serving import ServingGate
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
    store = await Store.open(settings.store, sqlite_synchronous=settings.sqlite_synchronous)
    pool = EnginePool(session, retries=settings.engine_retries, api_key=settings.engine_api_key())
    if settings.engines:
        has_active = any(v.active for v in await store.list_versions())
        await store.register_version(settings.model_version, settings.engines, activate=not has_active)
    for v in await store.list_versions():
        pool.set_version(v.version, v.engines)
        if v.active:
            pool.active = v.version
    await asyncio.gather(*(pool.check(e) for e in pool.engines()))
    metrics = GatewayMetrics()
    gate = ServingGate(default_hold_seconds=settings.hold_seconds)
    metrics.in_flight.set_function(lambda: gate.in_flight)
    metrics.held.set_function(lambda: gate.held)
    return CallService(
        store=store,
        pool=pool,
        prompts=PromptBuilder(tokenizer, store),
        tokenizer=tokenizer,
        gate=gate,
        metrics=metrics,
        max_model_len=settings.max_model_len or model_len,
        stop_token_ids=stops,
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
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            await calls.store.close()

    app = FastAPI(
        title="inharness gateway",
        version="v1alpha1",
        summary="OpenAI-compatible recording proxy and control API for RL in unmodified agent harnesses",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.admin_token_digest = hashlib.sha256(settings.admin_token.encode()).digest()
    app.state.progress = ProgressBoard()
    app.state.served_model_name = settings.served_model_name or Path(settings.model).name
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    for router in (openai_chat.router, openai_responses.router, anthropic_messages.router):
        app.include_router(router)
        app.include_router(router, prefix="/t/{token}")
    app.include_router(harness_api.router)
    app.include_router(harness_api.router, prefix="/t/{token}")
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
        if path in ("/healthz", "/metrics") or path.endswith("/v1/models"):  # no key, no body
            continue
        ref = "AnthropicError" if "/v1/messages" in path else "Error"
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
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


def serve(settings: GatewaySettings) -> None:
    import uvicorn
    import uvloop

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )
    server = uvicorn.Server(config)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn exposes no event)
            await asyncio.sleep(0.05)
        if server.started:
            print(f"gateway ready on http://{settings.host}:{settings.port}", file=sys.stderr, flush=True)
        await task

    uvloop.run(run())
