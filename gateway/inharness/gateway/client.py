"""Async client of the gateway's control API, for the trainer, the rollout controllers and tests.

Typed with the gateway's own wire schema; errors come back as `GatewayError` with the HTTP status
and the gateway's message.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import orjson

from inharness.gateway import schema


class GatewayError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"gateway answered {status}: {message}")
        self.status = status
        self.message = message
        self.code = code


# The gateway went away before answering: a request that reached it may or may not have been applied.
_DROPPED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


class GatewayClient:
    """`connect_retry_seconds`: how long a request is retried while the gateway is being restarted
    (`inharness run` restarts a dead one). A request that could not connect is retried whatever it is:
    it was never sent. One whose connection the gateway dropped before answering (it died mid-request)
    is retried only when applying it twice means the same as once: reads, and the requests marked
    `idempotent` (a model version registered or activated, the serving pause and resume, a progress
    report, holds, lease renewals); the others (claims, rollouts created, completions) fail, and their
    callers decide."""

    def __init__(
        self, base_url: str, admin_token: str, *, timeout: float = 60.0, connect_retry_seconds: float = 0.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.connect_retry_seconds = connect_retry_seconds
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=timeout
        )

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, body: Any = None, *, idempotent: bool = False, **params: Any
    ) -> httpx.Response:
        content = None if body is None else orjson.dumps(body)
        headers = {"content-type": "application/json"} if content is not None else None
        r = await self._connected(
            lambda: self._http.request(method, path, content=content, headers=headers, params=params or None),
            idempotent=idempotent or method == "GET",
        )
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                raise GatewayError(r.status_code, err.get("message", r.text), err.get("code"))
            except (ValueError, KeyError, TypeError):
                raise GatewayError(r.status_code, r.text) from None
        return r

    async def _connected(
        self, send: Callable[[], Awaitable[httpx.Response]], *, idempotent: bool
    ) -> httpx.Response:
        deadline = time.monotonic() + self.connect_retry_seconds
        retried = _DROPPED if idempotent else httpx.ConnectError
        delay = 0.1
        while True:
            try:
                return await send()
            except retried:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def create_rollouts(
        self,
        tasks: list[Any],
        *,
        group_size: int = 1,
        labels: dict[str, str] | None = None,
        pool: str = "default",
        max_attempts: int | None = None,
    ) -> list[schema.RolloutOut]:
        body = schema.CreateRollouts(
            tasks=tasks, group_size=group_size, labels=labels or {}, pool=pool, max_attempts=max_attempts
        )
        r = await self._call("POST", "/api/v1/rollouts", body.model_dump(mode="json"))
        return schema.CreateRolloutsResponse.model_validate_json(r.content).rollouts

    async def get_rollout(self, rollout_id: str) -> schema.RolloutOut:
        r = await self._call("GET", f"/api/v1/rollouts/{rollout_id}")
        return schema.RolloutOut.model_validate_json(r.content)

    async def claim(
        self, pool: str = "default", lease_seconds: float = 600.0, claim_key: str | None = None
    ) -> schema.ClaimedAttempt | None:
        """The oldest queued rollout's new attempt, or None. With a `claim_key` the claim is safe to
        repeat (see `schema.ClaimKey`): a dropped connection is retried like an idempotent call."""
        body = schema.ClaimRequest(pool=pool, lease_seconds=lease_seconds, claim_key=claim_key)
        r = await self._call(
            "POST",
            "/api/v1/attempts/claim",
            body.model_dump(mode="json", exclude_none=True),
            idempotent=claim_key is not None,
        )
        if r.status_code == 204:
            return None
        return schema.ClaimResponse.model_validate_json(r.content).attempt

    async def claim_batch(
        self,
        pool: str = "default",
        lease_seconds: float = 600.0,
        limit: int = 100,
        claim_key: str | None = None,
    ) -> list[schema.ClaimedAttempt]:
        """Up to `limit` attempts in one request (oldest queued first); [] when none is queued. A
        `claim_key` makes it safe to repeat, as for `claim`."""
        body = schema.ClaimBatchRequest(
            pool=pool, lease_seconds=lease_seconds, limit=limit, claim_key=claim_key
        )
        r = await self._call(
            "POST",
            "/api/v1/attempts/claim-batch",
            body.model_dump(mode="json", exclude_none=True),
            idempotent=claim_key is not None,
        )
        return schema.ClaimBatchResponse.model_validate_json(r.content).attempts

    async def heartbeat(self, attempt_id: str, lease_seconds: float | None = None) -> schema.AttemptOut:
        r = await self._call(
            "POST",
            f"/api/v1/attempts/{attempt_id}/heartbeat",
            {"lease_seconds": lease_seconds},
            idempotent=True,
        )
        return schema.AttemptOut.model_validate_json(r.content)

    async def heartbeat_batch(
        self, attempt_ids: Sequence[str], lease_seconds: float | None = None
    ) -> list[schema.LeaseRenewal]:
        """Renew many leases in one request (at most `schema.MAX_HEARTBEAT_BATCH` ids): one answer per
        id, in order, saying whether its lease was renewed or why not."""
        body = schema.HeartbeatBatchRequest(attempt_ids=list(attempt_ids), lease_seconds=lease_seconds)
        r = await self._call(
            "POST", "/api/v1/attempts/heartbeat-batch", body.model_dump(mode="json"), idempotent=True
        )
        return schema.HeartbeatBatchResponse.model_validate_json(r.content).attempts

    async def complete(
        self,
        attempt_id: str,
        status: schema.CompletionStatus,
        reward: float | None = None,
        info: dict[str, Any] | None = None,
    ) -> tuple[schema.AttemptOut, bool]:
        """Returns (attempt, duplicate); the attempt's `calls` counts its recorded calls (0: it ended
        before any model call was answered). "released" requeues the rollout without using up an
        attempt (no fault of the harness); info["reason"] becomes the failure_reason. Raises
        GatewayError 409 for a stale attempt."""
        body = schema.CompleteRequest(status=status, reward=reward, info=info or {})
        r = await self._call("POST", f"/api/v1/attempts/{attempt_id}/complete", body.model_dump(mode="json"))
        out = schema.CompleteResponse.model_validate_json(r.content)
        return out.attempt, out.duplicate

    async def release_running(self, pool: str = "default", *, reason: str | None = None) -> int:
        """Release every running attempt of the pool, passed leases included, requeuing their rollouts
        uncharged; returns how many were released. For a runner resuming after its process died."""
        body = {} if reason is None else schema.ReleaseRunning(reason=reason).model_dump(mode="json")
        r = await self._call("POST", f"/api/v1/pools/{pool}/release-running", body)
        return schema.ReleasedResponse.model_validate_json(r.content).released

    async def hold(self, rollout_ids: Sequence[str]) -> int:
        """Queued rollouts of these become held (not claimable); returns how many changed."""
        r = await self._call("POST", "/api/v1/rollouts/hold", {"ids": list(rollout_ids)}, idempotent=True)
        return schema.ChangedResponse.model_validate_json(r.content).changed

    async def unhold(self, rollout_ids: Sequence[str]) -> int:
        """Held rollouts of these become queued again; returns how many changed."""
        r = await self._call("POST", "/api/v1/rollouts/unhold", {"ids": list(rollout_ids)}, idempotent=True)
        return schema.ChangedResponse.model_validate_json(r.content).changed

    async def posted_reward(self, attempt_id: str) -> schema.PostedRewardOut | None:
        """The reward the attempt's harness posted to the gateway, or None if it posted none."""
        r = await self._call("GET", f"/api/v1/attempts/{attempt_id}/posted-reward")
        return schema.PostedRewardResponse.model_validate_json(r.content).posted

    async def calls(self, attempt_id: str, *, bodies: bool = True) -> list[schema.CallOut]:
        r = await self._call("GET", f"/api/v1/attempts/{attempt_id}/calls", bodies=str(bodies).lower())
        return schema.CallsResponse.model_validate_json(r.content).calls

    async def export(
        self,
        *,
        after: int = 0,
        limit: int = 100_000,
        bodies: bool = False,
        status: str | None = None,
        page: int | None = None,
    ) -> AsyncIterator[schema.ExportedRollout]:
        """Finished rollouts after cursor `after`, streamed line by line. An export that broke off is a
        GatewayError (its error line) or an httpx.RemoteProtocolError (its body ended unterminated), never
        a shorter iteration; resume from the last rollout's `cursor`."""
        params: dict[str, Any] = {"after": after, "limit": limit, "bodies": str(bodies).lower()}
        if status is not None:
            params["status"] = status
        if page is not None:
            params["page"] = page
        request = self._http.build_request("GET", "/api/v1/export/rollouts", params=params)
        r = await self._connected(lambda: self._http.send(request, stream=True), idempotent=True)
        try:
            if r.status_code >= 400:
                await r.aread()
                raise GatewayError(r.status_code, r.text)
            async for line in r.aiter_lines():
                if line.startswith('{"error":'):  # the gateway's last line of an export that broke off
                    error = orjson.loads(line)["error"]
                    raise GatewayError(500, error["message"], error.get("code"))
                if line:
                    yield schema.ExportedRollout.model_validate_json(line)
        finally:
            await r.aclose()

    async def register_version(self, version: int, engines: list[str], *, activate: bool = False) -> None:
        body = {"version": version, "engines": engines, "activate": activate}
        await self._call("POST", "/api/v1/models/versions", body, idempotent=True)

    async def activate_version(self, version: int) -> None:
        await self._call("POST", "/api/v1/models/active", {"version": version}, idempotent=True)

    async def versions(self) -> schema.ModelVersionsResponse:
        r = await self._call("GET", "/api/v1/models/versions")
        return schema.ModelVersionsResponse.model_validate_json(r.content)

    async def pause(
        self, *, hold_seconds: float | None = None, drain_seconds: float = 0.0
    ) -> schema.ServingState:
        body = {"hold_seconds": hold_seconds, "drain_seconds": drain_seconds}
        r = await self._call("POST", "/api/v1/serving/pause", body, idempotent=True)
        return schema.ServingState.model_validate_json(r.content)

    async def resume(self) -> schema.ServingState:
        return schema.ServingState.model_validate_json(
            (await self._call("POST", "/api/v1/serving/resume", idempotent=True)).content
        )

    async def serving(self) -> schema.ServingState:
        return schema.ServingState.model_validate_json((await self._call("GET", "/api/v1/serving")).content)

    async def report_progress(self, report: schema.ProgressReport) -> schema.ProgressOut:
        r = await self._call("POST", "/api/v1/progress", report.model_dump(mode="json"), idempotent=True)
        return schema.ProgressOut.model_validate_json(r.content)

    async def progress(self) -> schema.ProgressOut:
        return schema.ProgressOut.model_validate_json((await self._call("GET", "/api/v1/progress")).content)
