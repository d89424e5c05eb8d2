"""Control API for the trainer and the operator (admin token required): the rollout queue with
leases, recorded calls and their export, model versions, pause/resume of serving, and the trainer's
progress."""

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated

import orjson
from fastapi import APIRouter, Path, Query, Request
from starlette.responses import Response, StreamingResponse

from inharness.gateway import schema
from inharness.gateway.calls import CallService
from inharness.gateway.errors import APIError, error_response, protocol_route
from inharness.gateway.progress import ProgressBoard
from inharness.gateway.serving import LIVE_SECONDS, POLL_SECONDS, worker_report
from inharness.gateway.store import Conflict, NotFound, Store


async def require_admin(request: Request) -> None:
    """The control API's check, before any body is read (`errors.protocol_route`); constant-time."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    expected: bytes = request.app.state.admin_token_digest
    given = hashlib.sha256(value.strip().encode()).digest()  # equal lengths: the time tells nothing
    if not hmac.compare_digest(given, expected) or scheme.lower() != "bearer":
        raise APIError(
            401, "the control API needs 'Authorization: Bearer <admin token>'", code="invalid_admin_token"
        )


router = APIRouter(prefix="/api/v1", route_class=protocol_route(error_response, authenticate=require_admin))
log = logging.getLogger("inharness.gateway")

# Path parameters, bounded as the bodies' fields are: the OpenAPI document states it, and a longer value
# is a 400 naming the parameter before the store is asked.
RolloutId = Annotated[
    str, Path(min_length=1, max_length=schema.MAX_ID_LENGTH, description="the rollout's id (`ro-...`)")
]
AttemptId = Annotated[
    str, Path(min_length=1, max_length=schema.MAX_ID_LENGTH, description="the attempt's id (`at-...`)")
]
PoolName = Annotated[str, Path(min_length=1, max_length=schema.MAX_POOL_LENGTH, description="a rollout pool")]


def _store(request: Request) -> Store:
    return request.app.state.store


def _calls(request: Request) -> CallService:
    return request.app.state.calls


def _json(model: object, status: int = 200) -> Response:
    data = model.model_dump(mode="json") if hasattr(model, "model_dump") else model
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


@router.post("/rollouts", status_code=201)
async def create_rollouts(request: Request, body: schema.CreateRollouts) -> Response:
    store = _store(request)
    ids = await store.create_rollouts(body, default_max_attempts=request.app.state.settings.max_attempts)
    return _json(schema.CreateRolloutsResponse(rollouts=await store.get_rollouts(ids)), 201)


@router.get("/rollouts/{rollout_id}", response_model=schema.RolloutOut)
async def get_rollout(request: Request, rollout_id: RolloutId) -> Response:
    try:
        return _json(await _store(request).get_rollout(rollout_id))
    except NotFound as exc:
        raise APIError(404, str(exc)) from None


@router.post(
    "/attempts/claim", response_model=schema.ClaimResponse, responses={204: {"description": "none queued"}}
)
async def claim(request: Request, body: schema.ClaimRequest) -> Response:
    store = _store(request)
    expired = await store.expire_leases()
    if expired:
        _calls(request).metrics.leases_expired.inc(expired)
    attempt = await store.claim(body.pool, body.lease_seconds, body.claim_key)
    if attempt is None:
        return Response(status_code=204)
    return _json(schema.ClaimResponse(attempt=attempt))


@router.post("/attempts/claim-batch", response_model=schema.ClaimBatchResponse)
async def claim_batch(request: Request, body: schema.ClaimBatchRequest) -> Response:
    """Up to `limit` attempts of the pool in one request and one transaction (oldest queued first); a
    rollout controller starting many pods at once would otherwise pay a request per attempt."""
    store = _store(request)
    expired = await store.expire_leases()
    if expired:
        _calls(request).metrics.leases_expired.inc(expired)
    attempts = await store.claim_many(body.pool, body.lease_seconds, body.limit, body.claim_key)
    return _json(schema.ClaimBatchResponse(attempts=attempts))


@router.post("/attempts/{attempt_id}/heartbeat", response_model=schema.AttemptOut)
async def heartbeat(
    request: Request, attempt_id: AttemptId, body: schema.HeartbeatRequest | None = None
) -> Response:
    try:
        out = await _store(request).heartbeat(attempt_id, body.lease_seconds if body else None)
    except NotFound as exc:
        raise APIError(404, str(exc)) from None
    except Conflict as exc:
        _calls(request).forget_attempt(attempt_id)
        raise APIError(409, str(exc), code="attempt_not_running") from None
    _calls(request).lease_renewed(attempt_id, out.lease_expires_at)
    return _json(out)


@router.post("/attempts/heartbeat-batch", response_model=schema.HeartbeatBatchResponse)
async def heartbeat_batch(request: Request, body: schema.HeartbeatBatchRequest) -> Response:
    """Renew up to MAX_HEARTBEAT_BATCH leases in one request and one transaction; each id is answered
    renewed, finished, expired or unknown (never an error for one id), so that a controller's
    requests per attempt do not grow with how long its harnesses run."""
    renewals = await _store(request).heartbeat_many(body.attempt_ids, body.lease_seconds)
    calls = _calls(request)
    for r in renewals:
        if r.lease == "renewed" and r.lease_expires_at is not None:
            calls.lease_renewed(r.id, r.lease_expires_at)
        else:
            calls.forget_attempt(r.id)
    return _json(schema.HeartbeatBatchResponse(attempts=renewals))


@router.post("/attempts/{attempt_id}/complete", response_model=schema.CompleteResponse)
async def complete(request: Request, attempt_id: AttemptId, body: schema.CompleteRequest) -> Response:
    """Finish an attempt: succeeded, failed, or released (no fault of the harness: its rollout is
    requeued without using up an attempt). The answer's `attempt.calls` counts its recorded calls."""
    try:
        out, duplicate = await _store(request).complete(attempt_id, body)
    except NotFound as exc:
        raise APIError(404, str(exc)) from None
    except Conflict as exc:
        raise APIError(409, str(exc), code="stale_attempt") from None
    _calls(request).forget_attempt(attempt_id)
    return _json(schema.CompleteResponse(attempt=out, duplicate=duplicate))


@router.post("/pools/{pool}/release-running", response_model=schema.ReleasedResponse)
async def release_running(
    request: Request, pool: PoolName, body: schema.ReleaseRunning | None = None
) -> Response:
    """Release every running attempt of the pool (passed leases included) and requeue their rollouts
    uncharged, at once: a runner resuming after its process died owns attempts that will never
    complete, and their rollouts should not wait out the leases."""
    body = body or schema.ReleaseRunning()
    released = await _store(request).release_running(pool, body.reason)
    calls = _calls(request)
    for attempt_id in released:
        calls.forget_attempt(attempt_id)
    return _json(schema.ReleasedResponse(released=len(released)))


@router.post("/rollouts/hold", response_model=schema.ChangedResponse)
async def hold(request: Request, body: schema.RolloutIds) -> Response:
    """Queued rollouts become held, which no claim takes (running and finished ones are left alone):
    after a resume, rollouts made for a model version not yet served again must wait for it."""
    return _json(schema.ChangedResponse(changed=await _store(request).hold(body.ids)))


@router.post("/rollouts/unhold", response_model=schema.ChangedResponse)
async def unhold(request: Request, body: schema.RolloutIds) -> Response:
    """Held rollouts become queued again, claimable."""
    return _json(schema.ChangedResponse(changed=await _store(request).unhold(body.ids)))


@router.get("/attempts/{attempt_id}/posted-reward", response_model=schema.PostedRewardResponse)
async def posted_reward(request: Request, attempt_id: AttemptId) -> Response:
    """The reward the attempt's harness posted itself, if any (the rollout controller's fallback)."""
    try:
        return _json(schema.PostedRewardResponse(posted=await _store(request).posted_reward(attempt_id)))
    except NotFound as exc:
        raise APIError(404, str(exc)) from None


@router.get("/attempts/{attempt_id}/calls", response_model=schema.CallsResponse)
async def list_calls(request: Request, attempt_id: AttemptId, bodies: bool = True) -> Response:
    try:
        return _json(schema.CallsResponse(calls=await _store(request).list_calls(attempt_id, bodies=bodies)))
    except NotFound as exc:
        raise APIError(404, str(exc)) from None


@router.get("/export/rollouts", responses={200: {"content": {"application/x-ndjson": {}}}})
async def export_rollouts(
    request: Request,
    after: int = Query(
        default=0, ge=0, le=schema.MAX_INT64, description="cursor of the last rollout already read"
    ),
    limit: int = Query(default=1000, ge=1, le=100_000, description="rollouts to export at most"),
    page: int = Query(default=100, ge=1, le=1000, description="rollouts read from the store at a time"),
    bodies: bool = False,
    status: schema.RolloutStatus | None = None,
) -> Response:
    """Finished rollouts with their calls as JSONL, in the order they finished; each line's
    `cursor` is where to resume. Streamed page by page, so memory stays bounded.

    Every parameter is checked, and the first page read, before the first byte: bad input is a 400
    and a store that cannot answer a 500, both whole. A page that fails later ends the stream with an
    `{"error": {...}}` line carrying the cursor to resume from, and then without HTTP/1.1's last chunk
    (the connection is closed), so that a client can tell it from a complete export either way.
    """
    store = _store(request)

    async def read(cursor: int, left: int) -> list[schema.ExportedRollout]:
        return await store.export(after=cursor, limit=min(page, left), bodies=bodies, status=status)

    first = await read(after, limit)

    async def lines() -> AsyncIterator[bytes]:
        batch, cursor, left = first, after, limit
        while True:
            for item in batch:
                yield orjson.dumps(item.model_dump(mode="json")) + b"\n"
            if len(batch) < min(page, left):
                return
            cursor, left = batch[-1].cursor, left - len(batch)
            if left <= 0:
                return
            try:
                batch = await read(cursor, left)
            except Exception as exc:
                log.exception("the export broke off after cursor %d", cursor)
                message = f"the export broke off after cursor {cursor}: {type(exc).__name__}"
                error = {
                    "message": message,
                    "type": "server_error",
                    "code": "export_failed",
                    "cursor": cursor,
                }
                yield orjson.dumps({"error": error}) + b"\n"
                raise ExportBrokeOff(message) from exc

    return StreamingResponse(lines(), media_type="application/x-ndjson")


class ExportBrokeOff(RuntimeError):
    """Raised after the export's error line, so that the server closes the connection without the
    chunked body's terminator: a client that reads no lines still sees an incomplete response."""


@router.get("/models/versions", response_model=schema.ModelVersionsResponse)
async def list_versions(request: Request) -> Response:
    versions = await _store(request).list_versions()
    active = next((v.version for v in versions if v.active), None)
    return _json(schema.ModelVersionsResponse(active=active, versions=versions))


@router.post("/models/versions", response_model=schema.ModelVersionsResponse)
async def register_version(request: Request, body: schema.RegisterVersion) -> Response:
    store = _store(request)
    await store.register_version(body.version, body.engines, activate=body.activate)
    pool = _calls(request).pool
    pool.set_version(body.version, body.engines)
    for engine in pool.order("", body.version):
        await pool.check(engine)
    if body.activate:
        pool.activate(body.version)
    return await list_versions(request)


@router.post("/models/active", response_model=schema.ModelVersionsResponse)
async def activate_version(request: Request, body: schema.ActivateVersion) -> Response:
    try:
        await _store(request).activate_version(body.version)
    except NotFound as exc:
        raise APIError(404, str(exc)) from None
    _calls(request).pool.activate(body.version)
    return await list_versions(request)


@router.get("/serving", response_model=schema.ServingState)
async def serving_state(request: Request) -> Response:
    return _json(await _serving_everywhere(request))


async def _serving_everywhere(request: Request) -> schema.ServingState:
    """This process's gate, with the calls in flight and held in every other live process summed in."""
    state = _calls(request).gate.state()
    store = _store(request)
    if store.shared:
        for w in await store.workers(time.time() - LIVE_SECONDS):
            if w.id != request.app.state.worker_id:
                state.in_flight, state.held = state.in_flight + w.in_flight, state.held + w.held
    return state


@router.post("/serving/pause", response_model=schema.ServingState)
async def pause(request: Request, body: schema.PauseRequest | None = None) -> Response:
    """Pause every gateway process on the store; with `drain_seconds`, answer once every live process
    has applied this pause and finished its calls in flight, or the drain time has passed."""
    body = body or schema.PauseRequest()
    gate, store = _calls(request).gate, _store(request)
    deadline = time.monotonic() + body.drain_seconds
    shared = await store.set_serving(
        paused=True, resumes_at=time.time() + gate.hold_seconds(body.hold_seconds)
    )
    gate.apply(holding=True, resumes_at=shared.resumes_at, generation=shared.generation)
    await gate.drain(body.drain_seconds)
    if store.shared:
        await store.sync_worker(worker_report(gate, request.app.state.worker_id))  # applied here too
        # The other processes report through the store only: there is no event to wait on.
        while time.monotonic() < deadline and not await _drained(request, shared.generation):  # noqa: ASYNC110
            await asyncio.sleep(POLL_SECONDS / 2)
    return _json(await _serving_everywhere(request))


async def _drained(request: Request, generation: int) -> bool:
    """Whether every other live process has applied serving `generation` (or a later one) and is idle."""
    me = request.app.state.worker_id
    others = [w for w in await _store(request).workers(time.time() - LIVE_SECONDS) if w.id != me]
    return all(w.generation >= generation and w.in_flight == 0 for w in others)


@router.post("/serving/resume", response_model=schema.ServingState)
async def resume(request: Request) -> Response:
    gate = _calls(request).gate
    shared = await _store(request).set_serving(paused=False, resumes_at=None)
    gate.apply(holding=False, resumes_at=None, generation=shared.generation)
    return _json(await _serving_everywhere(request))


@router.post("/progress", response_model=schema.ProgressOut)
async def report_progress(request: Request, body: schema.ProgressReport) -> Response:
    store = _store(request)
    board = ProgressBoard.from_json(await store.load_progress())
    board.record(body)
    await store.save_progress(board.to_json())
    return await get_progress(request)


@router.get("/progress", response_model=schema.ProgressOut)
async def get_progress(request: Request) -> Response:
    store = _store(request)
    board = ProgressBoard.from_json(await store.load_progress())
    last = board.last
    active = next((v.version for v in await store.list_versions() if v.active), None)
    counts = await store.rollout_counts()
    return _json(
        schema.ProgressOut(
            reported=last is not None,
            step=last.step if last else 0,
            total_steps=last.total_steps if last else None,
            state=last.state if last else None,
            reward_mean=last.reward_mean if last else None,
            reward_history=board.history(),
            message=last.message if last else None,
            config_sha256=last.config_sha256 if last else None,
            model_version=active,
            rollouts=counts,
            updated_at=board.updated_at,
            ray_nodes=board.ray_nodes,
            ray_nodes_wanted=board.ray_nodes_wanted,
        )
    )
