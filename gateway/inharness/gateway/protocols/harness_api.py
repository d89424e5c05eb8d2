"""What a harness may say to the gateway besides model calls, with its attempt's key: its own reward.

Mounted like the model API, at `/v1/inharness/...` (key in `Authorization: Bearer`) and at
`/t/{key}/v1/inharness/...`, so a harness reaches it as `$OPENAI_BASE_URL/inharness/reward` with the
key it already has. A key only ever reaches its own attempt, and only while that attempt runs.
"""

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from inharness.gateway import schema
from inharness.gateway.calls import CallService
from inharness.gateway.errors import APIError
from inharness.gateway.protocols.common import attempt_key, harness_route
from inharness.gateway.store import Conflict, NotFound

router = APIRouter(route_class=harness_route())


@router.post("/v1/inharness/reward", status_code=200, response_model=schema.PostedRewardOut)
async def post_reward(request: Request, body: schema.PostReward) -> Response:
    """Keep the reward for the attempt whose key this is. The rollout controller uses it when the
    harness ends without a reward in its result (docs/rollouts.md, "Outcomes"); a later post replaces
    an earlier one."""
    svc: CallService = request.app.state.calls
    auth = await svc.authenticate(attempt_key(request))
    info = dict(body.model_extra or {})
    if len(orjson.dumps(info)) > schema.MAX_POSTED_INFO_BYTES:
        raise APIError(
            413, f"the posted keys besides reward exceed {schema.MAX_POSTED_INFO_BYTES} bytes", param="body"
        )
    try:
        out = await svc.store.post_reward(auth.id, body.reward, info)
    except NotFound as exc:
        raise APIError(401, str(exc), code="invalid_api_key") from None
    except Conflict as exc:
        svc.forget_attempt(auth.id)
        raise APIError(403, str(exc), code="attempt_finished") from None
    return Response(orjson.dumps(out.model_dump(mode="json")), media_type="application/json")
