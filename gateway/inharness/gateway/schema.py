"""Wire schema of the control API: rollouts, attempts, calls, model versions, serving state.

The gateway owns this protocol; the trainer and the operator import these models through
`inharness.gateway.client` rather than redefining them.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt

# held: queued but not claimable until unheld (POST /rollouts/hold, /rollouts/unhold).
RolloutStatus = Literal["queued", "held", "running", "succeeded", "failed"]
# released: ended through no fault of the harness (its runner stopped, its engine or gateway was down);
# the rollout is requeued and the attempt does not count against the rollout's max_attempts.
AttemptStatus = Literal["running", "succeeded", "failed", "released"]
CompletionStatus = Literal["succeeded", "failed", "released"]
RELEASED_BY_RUNNER = "released by runner"
MAX_ROLLOUT_IDS = 100_000
# Bounds of every integer a request carries (control API and harness protocols alike): the engines,
# the store's columns and every reader of a recorded request hold 64 bits (a JSON integer beyond
# them is parsed as a float, which these bounds then refuse).
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1
# The longest id a request may name: the store's are `ro-`/`at-` and 16 hex digits; anything longer is
# refused before the store is asked (a path or list of megabyte ids would otherwise be looked up).
MAX_ID_LENGTH = 64
MAX_POOL_LENGTH = 253  # a Kubernetes name: pools are named after RolloutPools
Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]


class _Wire(BaseModel):
    """A control API request: strict, so that a value of another JSON type is refused rather than
    converted (a boolean is no lease length, a string no number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CreateRollouts(_Wire):
    tasks: list[Any] = Field(min_length=1, max_length=100_000)
    group_size: int = Field(default=1, ge=1, le=1024)
    labels: dict[str, str] = Field(default_factory=dict)
    pool: str = Field(default="default", min_length=1, max_length=MAX_POOL_LENGTH)
    max_attempts: int | None = Field(default=None, ge=1, le=100, description="None: the gateway's default")


ClaimKey = Annotated[
    str | None,
    Field(
        min_length=8,
        max_length=64,
        description="a key the claimer chooses per claim: the same claim repeated with it (its answer was "
        "lost) is answered with the attempts that key already claimed, re-keyed, instead of new ones",
    ),
]


class ClaimRequest(_Wire):
    pool: str = Field(default="default", min_length=1, max_length=MAX_POOL_LENGTH)
    lease_seconds: float = Field(default=600.0, gt=0, le=86_400)
    claim_key: ClaimKey = None


MAX_CLAIM_BATCH = 1000


class ClaimBatchRequest(_Wire):
    pool: str = Field(default="default", min_length=1, max_length=MAX_POOL_LENGTH)
    lease_seconds: float = Field(default=600.0, gt=0, le=86_400)
    limit: int = Field(ge=1, le=MAX_CLAIM_BATCH, description="claim at most this many attempts")
    claim_key: ClaimKey = None


class HeartbeatRequest(_Wire):
    lease_seconds: float | None = Field(default=None, gt=0, le=86_400, description="None: the claimed lease")


MAX_HEARTBEAT_BATCH = 1000
# renewed: the lease runs on; finished: the attempt ended (succeeded, failed, released); expired: its
# lease passed before this renewal; unknown: no such attempt. Only `renewed` lets a harness run on.
LeaseState = Literal["renewed", "finished", "expired", "unknown"]


class HeartbeatBatchRequest(_Wire):
    """Renew many leases in one request: a controller with a thousand attempts in flight would
    otherwise send a thousand heartbeats per interval, however long its harnesses run."""

    attempt_ids: list[Id] = Field(min_length=1, max_length=MAX_HEARTBEAT_BATCH)
    lease_seconds: float | None = Field(
        default=None, gt=0, le=86_400, description="None: each attempt's claimed lease"
    )


class LeaseRenewal(BaseModel):
    id: str
    lease: LeaseState
    status: AttemptStatus | None = Field(description="the attempt's stored status; None when unknown")
    lease_expires_at: float | None = Field(description="the (renewed) lease's end; None when unknown")


class HeartbeatBatchResponse(BaseModel):
    attempts: list[LeaseRenewal] = Field(description="one per requested id, in the request's order")


class CompleteRequest(_Wire):
    status: CompletionStatus
    reward: float | None = Field(default=None, allow_inf_nan=False)
    info: dict[str, Any] = Field(
        default_factory=dict, description="info['reason']: the failure_reason of a failed or released attempt"
    )


class ReleaseRunning(_Wire):
    reason: str = Field(default=RELEASED_BY_RUNNER, min_length=1, max_length=4096)


class ReleasedResponse(BaseModel):
    released: int = Field(description="running attempts released, their rollouts requeued")


class RolloutIds(_Wire):
    ids: list[Id] = Field(max_length=MAX_ROLLOUT_IDS)


class ChangedResponse(BaseModel):
    changed: int = Field(description="rollouts whose status changed; the others were left as they were")


MAX_POSTED_INFO_BYTES = 65_536


class PostReward(BaseModel):
    """What a harness posts for its own attempt (POST <base URL>/inharness/reward, with its key):
    `{"reward": 0.5, ...}`, a result file's rules over HTTP. Other keys are kept as the posted info."""

    model_config = ConfigDict(extra="allow")

    reward: StrictFloat | StrictInt = Field(allow_inf_nan=False, description="a finite number, not a bool")


class PostedRewardOut(BaseModel):
    attempt_id: str
    reward: float
    info: dict[str, Any] = Field(default_factory=dict, description="the posted keys other than reward")
    posted_at: float
    posts: int = Field(description="how many times the harness posted; the latest post is the one kept")


class PostedRewardResponse(BaseModel):
    posted: PostedRewardOut | None = Field(description="None: the harness posted no reward")


class AttemptOut(BaseModel):
    id: str
    rollout_id: str
    seq: int
    status: AttemptStatus
    pool: str
    claimed_at: float
    lease_expires_at: float
    finished_at: float | None = None
    reward: float | None = None
    failure_reason: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    calls: int | None = Field(
        default=None,
        description="set in the completion answer only: calls recorded for the attempt (one per choice); "
        "0 means it ended before any model call was answered",
    )


class CompleteResponse(BaseModel):
    attempt: AttemptOut
    duplicate: bool = Field(description="the same completion was already stored; nothing changed")


class ClaimedAttempt(BaseModel):
    """What a rollout runner needs to start one harness run; `token` is shown only here."""

    id: str
    rollout_id: str
    group_id: str
    seq: int
    task: Any
    token: str
    lease_expires_at: float


class ClaimResponse(BaseModel):
    attempt: ClaimedAttempt


class ClaimBatchResponse(BaseModel):
    attempts: list[ClaimedAttempt] = Field(description="oldest queued first; empty when none is queued")


class RolloutOut(BaseModel):
    id: str
    group_id: str
    pool: str
    task: Any
    labels: dict[str, str]
    status: RolloutStatus
    reward: float | None = None
    max_attempts: int
    created_at: float
    finished_at: float | None = None
    attempts: list[AttemptOut] = Field(default_factory=list)


class CreateRolloutsResponse(BaseModel):
    rollouts: list[RolloutOut]


class CallOut(BaseModel):
    """One recorded model call (one choice of one request): the unit the trainer learns from."""

    id: int
    attempt_id: str
    rollout_id: str
    request_id: str
    choice_index: int
    protocol: str = Field(description="openai.chat, openai.responses or anthropic.messages")
    requested_model: str
    model_version: int
    engine: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    parent_call_id: int | None = Field(description="the call whose prompt+response this prompt extends")
    prefix_reused: bool
    prefix_mismatch: str | None = Field(
        description="why an earlier call of the attempt could not be extended"
    )
    started_at: float
    first_token_at: float | None
    finished_at: float
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    notes: list[str] = Field(
        default_factory=list,
        description="what of the request the prompt left out, and why (a tool type the model cannot run)",
    )


class CallsResponse(BaseModel):
    calls: list[CallOut]


class ExportedRollout(BaseModel):
    """One line of the export stream; `cursor` resumes the export after this rollout."""

    cursor: int
    rollout: RolloutOut
    calls: list[CallOut] = Field(description="calls of the rollout's final attempt, in order")


class RegisterVersion(_Wire):
    version: int = Field(ge=0, le=MAX_INT64)
    engines: list[Annotated[str, Field(min_length=1, max_length=2048)]] = Field(min_length=1, max_length=1024)
    activate: bool = False


class ActivateVersion(_Wire):
    version: int = Field(ge=0, le=MAX_INT64)


class ModelVersionOut(BaseModel):
    version: int
    engines: list[str]
    active: bool
    created_at: float


class ModelVersionsResponse(BaseModel):
    active: int | None
    versions: list[ModelVersionOut]


class ServingState(BaseModel):
    paused: bool
    in_flight: int = Field(description="harness calls admitted and not yet answered")
    held: int = Field(description="harness calls waiting for serving to resume")
    resumes_at: float | None = Field(description="when the hold timeout resumes serving by itself")


class PauseRequest(_Wire):
    hold_seconds: float | None = Field(default=None, gt=0, le=3600, description="None: the gateway's default")
    drain_seconds: float = Field(
        default=0.0, ge=0, le=3600, description="wait up to this long for in-flight calls to finish"
    )


ProgressState = Literal["starting", "running", "complete", "failed"]


class ProgressReport(_Wire):
    """What the trainer posts after each step, and once more when it finishes or fails; the operator
    reads it back (GET /api/v1/progress) into the TrainingRun's status.

    `starting`: the trainer is up but not training yet (engine verl: its Ray cluster is forming). It
    does not know its step before it loads its checkpoint, so such a report carries only the Ray
    counts: the gateway keeps the last step report as it was."""

    step: int = Field(ge=0, le=MAX_INT64, description="steps done so far")
    total_steps: int = Field(ge=1, le=MAX_INT64)
    state: ProgressState = "running"
    reward_mean: float | None = Field(
        default=None, allow_inf_nan=False, description="mean reward of the step just done"
    )
    message: str | None = Field(default=None, max_length=4096, description="why it failed, for example")
    config_sha256: str | None = Field(
        default=None,
        max_length=64,
        description="sha256 of the run config the trainer runs, so a report about an older config is "
        "recognisable as such",
    )
    ray_nodes: int | None = Field(
        default=None,
        ge=0,
        le=MAX_INT64,
        description="engine verl: Ray nodes with their GPUs that joined the cluster",
    )
    ray_nodes_wanted: int | None = Field(
        default=None, ge=1, le=MAX_INT64, description="engine verl: Ray nodes it needs"
    )


class ProgressOut(BaseModel):
    reported: bool = Field(description="whether the trainer has reported since the gateway started")
    step: int
    total_steps: int | None
    state: ProgressState | None
    reward_mean: float | None
    reward_history: list[float] = Field(description="reward means of the last 100 reported steps, in order")
    message: str | None
    config_sha256: str | None
    model_version: int | None = Field(description="the active model version")
    rollouts: dict[RolloutStatus, int] = Field(description="rollouts in the store by status")
    updated_at: float | None
    ray_nodes: int | None = Field(
        default=None, description="engine verl: Ray nodes joined, as the trainer last reported"
    )
    ray_nodes_wanted: int | None = Field(default=None, description="engine verl: Ray nodes the run needs")
