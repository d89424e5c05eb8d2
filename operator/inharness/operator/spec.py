"""TrainingRun, RolloutPool and HarnessSpec: the one definition of what a user writes.

The same models validate a local spec file and, turned into JSON schema, become the CRDs, so they
stick to what a CRD can say: camelCase names, `extra="forbid"`, defaults, numeric bounds, string
enums and a description on every field. Cross-field rules are validators whose errors point at the
field to change (`spec.scheduling.maxStaleness`), with messages that say what is allowed.
"""

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from inharness.operator.api import API_VERSION

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
_MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _dns_label(value: str) -> str:
    if len(value) > 63 or not re.fullmatch(_DNS_LABEL, value):
        raise PydanticCustomError(
            "dns_label",
            "'{value}' is not a valid name: use at most 63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (DNS-1123 label)",
            {"value": value},
        )
    return value


def _env_name(value: str) -> str:
    if not re.fullmatch(_ENV_NAME, value):
        raise PydanticCustomError(
            "env_name",
            "'{value}' is not a valid environment variable name: use letters, digits, '_', '-' and '.', "
            "not starting with a digit",
            {"value": value},
        )
    return value


def _module_name(value: str) -> str:
    if len(value) > 200 or not re.fullmatch(_MODULE_NAME, value):
        raise PydanticCustomError(
            "module_name",
            "'{value}' is not a Python module name: use dotted identifiers such as openai or "
            "transformers.models, at most 200 characters",
            {"value": value},
        )
    return value


def _spec_error(message: str, **ctx: Any) -> PydanticCustomError:
    """A validation error without pydantic's "Value error, " prefix: the message is the whole story."""
    return PydanticCustomError("invalid_spec", message, ctx or None)


def _cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One CEL `x-kubernetes-validations` rule: the API server's copy of the validator it sits beside,
    so that `kubectl apply` rejects what `inharness run` rejects, with the same words."""
    out = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    if reason is not None:
        out["reason"] = reason
    return out


def _is_set(path: str) -> str:
    """CEL for "the optional field at path holds a value". Fields that may be null are `nullable` in
    the CRD, so the API server keeps an explicit null and has() alone would call it set."""
    return f"(has({path}) && type({path}) != null_type)"


def _rules(*rules: dict[str, str]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


DnsLabel = Annotated[
    str,
    AfterValidator(_dns_label),
    Field(min_length=1, json_schema_extra={"pattern": _DNS_LABEL, "maxLength": 63}),
]
EnvName = Annotated[str, AfterValidator(_env_name), Field(json_schema_extra={"pattern": _ENV_NAME})]
ModuleName = Annotated[
    str, AfterValidator(_module_name), Field(json_schema_extra={"pattern": _MODULE_NAME, "maxLength": 200})
]


class SpecModel(BaseModel):
    """camelCase on the wire (YAML, CRD), snake_case in Python; unknown fields are errors, not typos
    silently ignored."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, serialize_by_alias=True, extra="forbid"
    )


class ObjectMeta(SpecModel):
    name: DnsLabel = Field(description="Name of the object, unique per kind (and namespace).")
    namespace: DnsLabel | None = Field(
        default=None, description="Kubernetes namespace; ignored by local runs."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Kubernetes labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Kubernetes annotations.")


class ObjectRef(SpecModel):
    name: DnsLabel = Field(description="metadata.name of the referenced object (same namespace).")


# --- HarnessSpec -------------------------------------------------------------------------------------


class EnvVar(SpecModel):
    name: EnvName = Field(description="Environment variable name.")
    value: str = Field(default="", description="Environment variable value.")


class ModelEndpoint(SpecModel):
    """How the harness is pointed at the gateway: through the environment variables it already reads."""

    base_url_env: EnvName = Field(
        default="OPENAI_BASE_URL",
        description="Env var that receives the gateway's OpenAI-compatible base URL (ending in /v1).",
    )
    api_key_env: EnvName = Field(
        default="OPENAI_API_KEY",
        description="Env var that receives the attempt-scoped API key (a placeholder when keyIn is path).",
    )
    model_name_env: EnvName | None = Field(
        default="OPENAI_MODEL",
        description="Env var that receives modelName; null for harnesses that take the model elsewhere.",
    )
    model_name: str = Field(
        default="policy",
        min_length=1,
        description="Model name the harness asks for; the gateway serves the current policy under any name.",
    )
    key_in: Literal["header", "path"] = Field(
        default="header",
        description="header: the key is sent as 'Authorization: Bearer <key>'. path: for harnesses that "
        "cannot set a key, the base URL carries it as {gateway}/t/<key>/v1.",
    )


class TaskInput(SpecModel):
    """How the harness receives its task (JSON): in an env var, in a file, or both."""

    model_config = _rules(
        _cel(
            f"{_is_set('self.env')} || {_is_set('self.fileEnv')}",
            "at least one of env and fileEnv must be set, or the harness never sees its task",
            reason="FieldValueRequired",
        )
    )

    env: EnvName | None = Field(
        default="INHARNESS_TASK", description="Env var that holds the task as a JSON string; null: none."
    )
    file_env: EnvName | None = Field(
        default="INHARNESS_TASK_FILE",
        description="Env var that holds the path of a file with the task as JSON; null: none.",
    )

    @model_validator(mode="after")
    def _one_way_in(self) -> "TaskInput":
        if self.env is None and self.file_env is None:
            raise _spec_error(
                "at least one of env and fileEnv must be set, or the harness never sees its task"
            )
        return self


class Grader(SpecModel):
    command: list[str] = Field(
        min_length=1,
        description="Grader command and arguments, run after the harness exits. It sees the task (same "
        "env/file convention as the harness), the harness's exit code in INHARNESS_EXIT_CODE, its stdout "
        "in the file at INHARNESS_OUTPUT_FILE, the harness's result file (if it wrote one) at "
        "INHARNESS_HARNESS_RESULT_FILE, and writes its own result JSON to the file named by resultFileEnv. "
        "On the kubernetes backend it is the pod's container, in the harness's image, after the harness "
        "(an init container) exited 0; there INHARNESS_OUTPUT_FILE is not set (see docs/rollouts.md).",
    )
    timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=86_400,
        description="The grader is killed and the attempt fails after this. On the kubernetes backend "
        "the pod's activeDeadlineSeconds is the harness's timeoutSeconds plus this, for both together.",
    )


class Outcome(SpecModel):
    """Where the reward of one harness run comes from."""

    model_config = _rules(
        _cel(
            f"self.type != 'grader' || {_is_set('self.grader')}",
            "grader is required when type is grader",
            field_path=".grader",
            reason="FieldValueRequired",
        ),
        _cel(
            f"self.type == 'grader' || !{_is_set('self.grader')}",
            "grader is only allowed when type is grader",
            field_path=".grader",
            reason="FieldValueForbidden",
        ),
    )

    type: Literal["resultFile", "exitCode", "grader"] = Field(
        default="resultFile",
        description='resultFile: the harness writes JSON like {"reward": 1.0} to the result file and exits '
        "0; with no reward there, a reward it posted to the gateway ($OPENAI_BASE_URL/inharness/reward) "
        "counts. exitCode: reward 1.0 on exit 0, else 0.0. grader: a grader command computes the reward.",
    )
    result_file_env: EnvName = Field(
        default="INHARNESS_RESULT_FILE",
        description="Env var that holds the path of the result file (on a cluster: the termination "
        "message path, so at most 4 KiB).",
    )
    grader: Grader | None = Field(
        default=None, validate_default=True, description="Required when type is grader, else not allowed."
    )

    @field_validator("grader")
    @classmethod
    def _grader_iff_type(cls, grader: Grader | None, info: ValidationInfo) -> Grader | None:
        kind = info.data.get("type")
        if kind == "grader" and grader is None:
            raise _spec_error("required when type is grader")
        if kind not in (None, "grader") and grader is not None:
            raise _spec_error("only allowed when type is grader (type is {kind})", kind=kind)
        return grader


# Kubernetes' resource.Quantity in its string form (its own CRDs use this pattern); plain integers too.
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
_QUANTITY = rf"^(\+|-)?{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_DECIMAL}))?$"
Quantity = Annotated[str, Field(pattern=_QUANTITY)] | int


class ResourceRequirements(SpecModel):
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Resource requests, e.g. {cpu: '2', memory: 8Gi}."
    )
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits.")


# The resources of every container the operator creates unless the spec says otherwise (render/ applies
# them; the descriptions below quote them): requests so that the scheduler, quotas and Kueue can place
# each pod, limits so that none can starve its node. A spec's resources merge over them per key.
Resources = dict[str, dict[str, str]]
HARNESS_RESOURCES: Resources = {
    "requests": {"cpu": "250m", "memory": "512Mi"},
    "limits": {"cpu": "2", "memory": "4Gi"},
}
GATEWAY_RESOURCES: Resources = {
    "requests": {"cpu": "500m", "memory": "1Gi"},
    "limits": {"cpu": "2", "memory": "4Gi"},
}
TRAINER_CPU_RESOURCES: Resources = {
    "requests": {"cpu": "1", "memory": "4Gi"},
    "limits": {"cpu": "4", "memory": "16Gi"},
}
TRAINER_RESOURCES_PER_GPU: dict[str, dict[str, int]] = {
    "requests": {"cpu": 4, "memory": 32},  # cores, GiB
    "limits": {"cpu": 8, "memory": 64},
}


def _shown(resources: Resources) -> str:
    return "; ".join(
        f"{part} " + ", ".join(f"{k} {v}" for k, v in values.items()) for part, values in resources.items()
    )


_TRAINER_PER_GPU = "; ".join(
    f"{part} " + ", ".join(f"{k} {v}{'Gi' if k == 'memory' else ''}" for k, v in values.items())
    for part, values in TRAINER_RESOURCES_PER_GPU.items()
)


class HarnessSpecSpec(SpecModel):
    """One harness run: the process (or container) to start per attempt, and how to read its outcome."""

    image: str | None = Field(
        default=None, min_length=1, description="Container image; required on clusters, unused locally."
    )
    command: list[str] = Field(min_length=1, description="Executable and leading arguments.")
    args: list[str] = Field(default_factory=list, description="Arguments appended to command.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    working_dir: str | None = Field(
        default=None,
        min_length=1,
        description="Working directory. Locally, a relative path resolves against the spec file's "
        "directory, and unset means that directory.",
    )
    model: ModelEndpoint = Field(
        default_factory=ModelEndpoint, description="How the harness finds the gateway."
    )
    task: TaskInput = Field(default_factory=TaskInput, description="How the harness receives its task.")
    timeout_seconds: int = Field(
        default=600, ge=1, le=86_000, description="The harness is killed and the attempt fails after this."
    )
    outcome: Outcome = Field(default_factory=Outcome, description="How the reward is read.")
    resources: ResourceRequirements | None = Field(
        default=None,
        description="What one attempt's pod needs on a cluster (each of its containers: the harness, and "
        f"the grader), merged per key over the defaults ({_shown(HARNESS_RESOURCES)}); a RolloutPool's "
        "kubernetes.pod.resources merges over these. Kueue admits pods by their requests. Unused locally.",
    )


class HarnessSpec(SpecModel):
    """No controller writes a HarnessSpec's status, so it has no status model (and its CRD no status
    subresource)."""

    status_model: ClassVar[type[SpecModel] | None] = None

    api_version: Literal[API_VERSION] = Field(description=f"Always {API_VERSION}.")
    kind: Literal["HarnessSpec"] = Field(description="Always HarnessSpec.")
    metadata: ObjectMeta = Field(description="Name and Kubernetes metadata.")
    spec: HarnessSpecSpec = Field(description="The harness process and its outcome.")
    status: dict[str, Any] | None = Field(default=None, description="Written by the operator.")


# --- status (written by the operator) ----------------------------------------------------------------

_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(SpecModel):
    """metav1.Condition: lastTransitionTime moves only when status changes."""

    type: str = Field(min_length=1, max_length=316, description="Ready, Progressing, Degraded, ...")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1, max_length=1024, pattern=_REASON, description="CamelCase reason of the last transition."
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation this condition was set for."
    )


# Conditions are a list keyed by type, as in Kubernetes' own APIs (server-side apply merges by type).
_CONDITIONS_LIST: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class TrainingRunStatus(SpecModel):
    observed_generation: int | None = Field(
        default=None, ge=0, description="Generation the status describes."
    )
    phase: Literal["Pending", "Running", "Suspended", "Complete", "Failed"] | None = Field(
        default=None, description="Where the run stands."
    )
    step: int = Field(default=0, ge=0, description="Training steps done.")
    model_version: int | None = Field(default=None, ge=0, description="Model version the gateway serves.")
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step.")
    rollouts_done: int | None = Field(default=None, ge=0, description="Rollouts that succeeded.")
    rollouts_failed: int | None = Field(
        default=None, ge=0, description="Rollouts given up after all attempts."
    )
    reward_history: list[float] = Field(
        default_factory=list, max_length=100, description="Mean reward of each of the last 100 steps."
    )
    ray_nodes: int | None = Field(
        default=None,
        ge=0,
        description="Engine verl: Ray nodes (trainer pods with their GPUs) that joined the trainer's "
        "Ray cluster, as the trainer last reported; null for engine torch.",
    )
    ray_nodes_wanted: int | None = Field(
        default=None, ge=1, description="Engine verl: the Ray nodes the run needs (spec.trainer.nodes)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, Suspended, Complete, Failed; RayClusterReady with "
        "engine verl.",
        json_schema_extra=_CONDITIONS_LIST,
    )
    start_time: str | None = Field(default=None, description="When training started (RFC 3339).")
    completion_time: str | None = Field(default=None, description="When the run completed or failed.")


class RolloutPoolStatus(SpecModel):
    observed_generation: int | None = Field(
        default=None, ge=0, description="Generation the status describes."
    )
    queued: int = Field(default=0, ge=0, description="Attempts waiting in the gateway's queue.")
    running: int = Field(default=0, ge=0, description="Harness runs in progress.")
    succeeded: int = Field(default=0, ge=0, description="Attempts that succeeded.")
    failed: int = Field(default=0, ge=0, description="Attempts that failed.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Degraded, GatewayReachable.",
        json_schema_extra=_CONDITIONS_LIST,
    )


# --- RolloutPool -------------------------------------------------------------------------------------


class RolloutPoolSpec(SpecModel):
    """Runners for one gateway queue: claim attempts, run the harness for each, report the outcome."""

    model_config = _rules(
        _cel(
            f"!{_is_set('self.leaseSeconds')} || self.heartbeatSeconds < self.leaseSeconds",
            "heartbeatSeconds must be less than leaseSeconds, or leases expire between heartbeats",
            field_path=".heartbeatSeconds",
            reason="FieldValueInvalid",
        )
    )

    harness_ref: ObjectRef = Field(description="The HarnessSpec each attempt runs.")
    parallelism: int = Field(default=4, ge=1, le=10_000, description="Harness runs at once, at most.")
    max_attempts_per_rollout: int = Field(
        default=2, ge=1, le=20, description="A rollout whose attempts all fail is given up after this many."
    )
    backend: Literal["local", "kubernetes"] = Field(
        default="local",
        description="local: only for `inharness run`, which runs each attempt as a local process; the "
        "operator refuses it (Ready False, BackendLocal). kubernetes: under the operator, one pod per "
        "attempt from the HarnessSpec's image (required); under `inharness run`, local processes as "
        "for local, the image unused.",
    )
    lease_seconds: int | None = Field(
        default=None,
        ge=10,
        le=86_400,
        description="Lease of a claimed attempt, renewed by heartbeats; when a runner dies, the gateway "
        "requeues its attempts after this. Default: the harness's timeoutSeconds + 60.",
    )
    heartbeat_seconds: int = Field(
        default=10,
        ge=1,
        le=3_600,
        validate_default=True,
        description="How often a running attempt's lease is renewed; must be less than the lease.",
    )
    kubernetes: "KubernetesPool" = Field(
        default_factory=lambda: KubernetesPool(),
        description="Settings of the kubernetes backend (one pod per attempt); ignored by local runs.",
    )
    local: "LocalPool" = Field(
        default_factory=lambda: LocalPool(),
        description="Settings of local harness processes (`inharness run`, either backend); ignored on a "
        "cluster.",
    )

    @field_validator("heartbeat_seconds")
    @classmethod
    def _beats_within_lease(cls, beat: int, info: ValidationInfo) -> int:
        lease = info.data.get("lease_seconds")
        if lease is not None and beat >= lease:
            raise _spec_error(
                "must be less than leaseSeconds ({lease}), or leases expire between heartbeats", lease=lease
            )
        return beat

    def lease_for(self, harness: HarnessSpecSpec) -> int:
        """The lease to claim with: leaseSeconds, or long enough for the harness to run out its time."""
        return self.lease_seconds if self.lease_seconds is not None else harness.timeout_seconds + 60


_POOL_USED = (
    "has(oldSelf.status) && ("
    + " || ".join(
        f"(has(oldSelf.status.{count}) && oldSelf.status.{count} > 0)"
        for count in ("queued", "running", "succeeded", "failed")
    )
    + ")"
)


class RolloutPool(SpecModel):
    """status stays free-form here (local runs ignore it; a status exported from a cluster running
    another version still loads); the operator writes it through status_model, which is also the
    CRD's status schema.

    The harness is fixed once the pool has run attempts (a transition rule, like TrainingRun's):
    rewards of one queue would otherwise come from two harnesses."""

    model_config = _rules(
        _cel(
            f"!({_POOL_USED}) || self.spec.harnessRef == oldSelf.spec.harnessRef",
            "spec.harnessRef cannot change once the pool has run attempts (a status count is above 0); "
            "create a new RolloutPool instead",
            field_path=".spec.harnessRef",
            reason="FieldValueForbidden",
        )
    )

    status_model: ClassVar[type[SpecModel] | None] = RolloutPoolStatus

    api_version: Literal[API_VERSION] = Field(description=f"Always {API_VERSION}.")
    kind: Literal["RolloutPool"] = Field(description="Always RolloutPool.")
    metadata: ObjectMeta = Field(description="Name (also the gateway queue's pool name) and metadata.")
    spec: RolloutPoolSpec = Field(description="Runners and their limits.")
    status: dict[str, Any] | None = Field(default=None, description="Written by the operator.")


# --- TrainingRun -------------------------------------------------------------------------------------


class PolicyModel(SpecModel):
    # max_length: the CRD's immutability rule compares the model, and CEL's cost estimate needs a bound.
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Model directory (weights, tokenizer); locally relative to the spec file.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Training precision.")


class Dataset(SpecModel):
    """Exactly one of inline tasks or a JSONL file of tasks; each task is what one harness run gets."""

    model_config = _rules(
        _cel(
            f"{_is_set('self.tasks')} != {_is_set('self.path')}",
            "set exactly one of tasks and path",
            reason="FieldValueInvalid",
        )
    )

    tasks: list[Any] | None = Field(
        default=None, min_length=1, description="Tasks inline, each any JSON value."
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="JSONL file with one task per line; locally relative to the spec file.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "Dataset":
        if (self.tasks is None) == (self.path is None):
            which = "both are" if self.tasks is not None else "neither is"
            raise _spec_error("set exactly one of tasks and path ({which} set)", which=which)
        return self


class Algorithm(SpecModel):
    advantage_estimator: Literal["grpo", "rloo"] = Field(
        default="grpo", description="grpo: reward minus group mean. rloo: reward minus leave-one-out mean."
    )
    advantage_level: Literal["rollout", "sample"] = Field(
        default="rollout",
        description="rollout: one advantage per rollout, shared by its samples. sample: per sample.",
    )
    loss_normalization: Literal["token", "sample", "rollout"] = Field(
        default="rollout", description="What the policy loss averages over: tokens, samples or rollouts."
    )
    normalize_by_std: bool = Field(default=True, description="Divide advantages by the group's std.")
    learning_rate: float = Field(default=1e-5, gt=0, le=1, description="Optimizer learning rate.")
    lr_warmup_steps: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Optimizer steps over which the learning rate rises linearly to learningRate; 0: none. "
        "AdamW's first steps move every weight by about the learning rate, which can break a small "
        "policy's output format in one update.",
    )
    clip_ratio_low: float = Field(
        default=0.2, ge=0, le=1, description="PPO clip: ratios below 1 - clipRatioLow are clipped."
    )
    clip_ratio_high: float = Field(
        default=0.28, ge=0, le=10, description="PPO clip: ratios above 1 + clipRatioHigh are clipped."
    )
    kl_coef: float = Field(default=0.0, ge=0, le=100, description="Weight of the KL penalty; 0: none.")
    grad_clip: float | None = Field(
        default=1.0,
        gt=0,
        le=1_000,
        description="Each optimizer step's gradient is scaled down to this global norm when above it; "
        "null: never. Set it near the usual norm (metrics.jsonl grad_norm) to keep one outlier batch "
        "from moving AdamW's weights several times further than the others.",
    )
    group_size: int = Field(
        default=8, ge=2, le=1024, description="Rollouts per task; advantages compare within a group."
    )
    ppo_mini_batches: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Optimizer steps per pass over a step's batch, each on a share of its rollouts; "
        "above 1 the policy moves between steps and the clip ratios bound it.",
    )
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="Passes over each step's batch.")
    off_policy_correction: Literal["bypass", "tis"] = Field(
        default="bypass",
        description="How training corrects for samples drawn by another policy than the trained one (the "
        "inference engine's numerics; versions behind in the async modes). bypass: the PPO ratio is taken "
        "against the behaviour log-probs the gateway recorded. tis: against the trainer's log-probs at the "
        "update's start, each token's loss weighed by their ratio to the behaviour log-probs, truncated at "
        "tisCap (token-level truncated importance sampling; one more forward pass per update).",
    )
    tis_cap: float = Field(
        default=2.0,
        ge=1,
        le=1_000,
        description="offPolicyCorrection tis: the most a token's importance weight may be; a lower cap "
        "trades variance for bias.",
    )
    context_gradient: bool = Field(
        default=True,
        description="false: each micro-batch's context before its first generated token runs without "
        "gradient (trainer.engine torch only). The loss is the same; "
        "the gradient reaches the weights through the generated turns and what follows them only, so a "
        "harness's long prompt costs a forward pass, not a forward and a backward.",
    )
    max_tokens_per_sample: int | None = Field(
        default=None, ge=1, description="Longer samples are truncated for training; null: no limit."
    )


class Scheduling(SpecModel):
    model_config = _rules(
        _cel(
            "self.mode != 'sync' || self.maxStaleness == 0",
            "maxStaleness must be 0 when mode is sync; use mode async",
            field_path=".maxStaleness",
            reason="FieldValueInvalid",
        ),
        _cel(
            "self.mode != 'async' || self.maxStaleness >= 1",
            "maxStaleness must be at least 1 when mode is async",
            field_path=".maxStaleness",
            reason="FieldValueInvalid",
        ),
        _cel(
            "self.mode != 'collocated-async' || self.maxStaleness >= 1",
            "maxStaleness must be at least 1 when mode is collocated-async",
            field_path=".maxStaleness",
            reason="FieldValueInvalid",
        ),
    )

    mode: Literal["sync", "async", "collocated-async"] = Field(
        default="sync",
        description="sync: rollouts of a step use the latest policy. async: rollouts continue during "
        "updates, up to maxStaleness versions behind. collocated-async: inference and training share "
        "devices; an update starts as soon as batchSize groups are complete, holds model calls while it "
        "trains, and drops (then re-runs) a group more than maxStaleness versions behind.",
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        le=16,
        validate_default=True,
        description="How many policy versions a training sample may lag; 0 in sync mode, >= 1 in the "
        "async modes.",
    )

    @field_validator("max_staleness")
    @classmethod
    def _staleness_fits_mode(cls, staleness: int, info: ValidationInfo) -> int:
        mode = info.data.get("mode")
        if mode == "sync" and staleness != 0:
            raise _spec_error("must be 0 when mode is sync (got {got}); use mode async", got=staleness)
        if mode in ("async", "collocated-async") and staleness < 1:
            raise _spec_error(f"must be at least 1 when mode is {mode} (got {{got}})", got=staleness)
        return staleness


class Generation(SpecModel):
    """Sampling of the policy while it serves rollouts: the gateway applies it to every call, whatever the
    harness asks, and the trainer scores the samples at the same temperature."""

    temperature: float = Field(
        default=1.0,
        ge=0,
        le=2,
        description="Sampling temperature of every call, whatever temperature the harness asks.",
    )
    max_tokens: int = Field(
        default=512,
        ge=1,
        le=1_000_000,
        description="Most tokens generated per call: a harness asking more, or nothing, gets this many.",
    )


class Checkpoint(SpecModel):
    dir: str | None = Field(
        default=None,
        min_length=1,
        description="Where checkpoints go; locally relative to the spec file. Null: the run's work dir.",
    )
    interval: int = Field(default=5, ge=1, description="Save every this many steps.")
    keep: int = Field(default=3, ge=1, description="Newest checkpoints kept; older ones are deleted.")


class Toleration(SpecModel):
    key: str | None = Field(default=None, description="Taint key; empty with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (Kubernetes' default: Equal)."
    )
    value: str | None = Field(default=None, description="Taint value, for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty: all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated; empty: forever."
    )


class LocalObjectReference(SpecModel):
    name: DnsLabel = Field(description="Name of the Secret (same namespace).")


class PodEnvVar(SpecModel):
    name: EnvName = Field(description="Environment variable name.")
    value: str = Field(default="", description="Environment variable value.")


class Volume(SpecModel):
    """A Kubernetes Volume: its name typed (overrides replace defaults by name), the volume source
    (emptyDir, persistentVolumeClaim, secret, ...) passed through as written."""

    model_config = ConfigDict(extra="allow")

    name: DnsLabel = Field(description="Volume name; one named like a default (store, work) replaces it.")


class VolumeMount(SpecModel):
    """A Kubernetes VolumeMount: name and mountPath typed, the rest (readOnly, subPath, ...) as written."""

    model_config = ConfigDict(extra="allow")

    name: DnsLabel = Field(description="Name of the volume to mount.")
    mount_path: str = Field(
        min_length=1, description="Where it is mounted; one at a default's mountPath replaces it."
    )


class PodOverrides(SpecModel):
    """The allowlisted parts of a pod a user may set (never its security context or command).

    Small Kubernetes types are typed here; affinity and the sources of volumes (and the rest of a
    mount) are passed through as written: their full schemas are Kubernetes' PodSpec pieces, which
    would make each CRD hundreds of kilobytes (three copies) and break GitOps tools that store CRDs
    in annotations, and the API server validates them anyway when the operator creates the pod.
    """

    resources: ResourceRequirements | None = Field(
        default=None, description="Merged per key over the defaults of the container."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Pod tolerations (added).")
    affinity: dict[str, Any] | None = Field(
        default=None, description="Pod affinity (a Kubernetes Affinity, as written)."
    )
    env: list[PodEnvVar] = Field(
        default_factory=list, description="Container env vars; one named like a default replaces it."
    )
    volumes: list[Volume] = Field(
        default_factory=list, description="Pod volumes; one named like a default (store, work) replaces it."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Container mounts; one at a default's mountPath replaces it."
    )
    service_account_name: str | None = Field(
        default=None, min_length=1, description="Pod serviceAccountName."
    )
    priority_class_name: str | None = Field(default=None, min_length=1, description="Pod priorityClassName.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Pod imagePullSecrets, e.g. [{name: regcred}]."
    )


class KubernetesPool(SpecModel):
    """How the kubernetes backend runs and cleans up its harness pods (one bare Pod per attempt, or one
    Job per attempt with `workload: Job`)."""

    workload: Literal["Pod", "Job"] = Field(
        default="Pod",
        description="What each attempt runs as: a bare Pod (one API object per attempt; Kueue admits it "
        "through its pod integration) or a batch/v1 Job of that pod (run once, the gateway retries; what "
        "Kueue admits with its default configuration). See docs/rollouts.md.",
    )

    ttl_seconds_after_finished: int = Field(
        default=60,
        ge=0,
        le=604_800,
        description="A finished harness pod is deleted this long after its outcome was reported; 0: at once.",
    )
    keep_failed: int = Field(
        default=5,
        ge=0,
        le=1_000,
        description="The newest this many failed pods are kept past the TTL, for kubectl logs and describe; "
        "older failed pods are deleted once their TTL has passed.",
    )
    unschedulable_grace_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="A pod the scheduler reports Unschedulable this long fails its attempt (Unschedulable); "
        "raise it where a cluster autoscaler adds nodes.",
    )
    image_pull_grace_seconds: int = Field(
        default=120,
        ge=0,
        le=86_400,
        description="A pod whose image pull keeps failing (ErrImagePull, ImagePullBackOff) or whose "
        "container cannot be created this long fails its attempt.",
    )
    queue_name: DnsLabel | None = Field(
        default=None,
        description="Kueue LocalQueue of the harness pods (label kueue.x-k8s.io/queue-name, for Kueue's pod "
        "integration); null: no Kueue.",
    )
    pod: PodOverrides | None = Field(
        default=None,
        description="Overrides of the harness pods: resources (merged over the HarnessSpec's), nodeSelector, "
        "tolerations, affinity, env, volumes and mounts, serviceAccountName, priorityClassName, "
        "imagePullSecrets.",
    )


class LocalPool(SpecModel):
    """How `inharness run` starts its harness processes."""

    preload: list[ModuleName] = Field(
        default_factory=list,
        max_length=32,
        description="Python modules imported once by a preload process that forks each attempt's "
        "harness, instead of every attempt's interpreter importing them again (e.g. [openai]: about "
        "0.8 s of CPU per attempt). Used when the harness command is `python SCRIPT ...` or "
        "`python -m MODULE ...` with the interpreter of `inharness run`; other commands run as usual, "
        "said in one line. Local processes only (`inharness run`, either backend); ignored on a cluster.",
    )


class SecretKeySelector(SpecModel):
    name: DnsLabel = Field(description="Name of the Secret (same namespace).")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="Key of the Secret's data."
    )


class GatewayStore(SpecModel):
    url_secret: SecretKeySelector | None = Field(
        default=None,
        description="The Secret key holding the store's database URL, "
        "postgresql://USER:PASSWORD@HOST:PORT/DATABASE: the gateway gets it as an env var set from the "
        "Secret (never in the pod spec), migrates the database on start, and its replicas share it. "
        "Null: SQLite on the run's gateway-store claim, one replica. Cluster only: local runs keep SQLite "
        "in the run directory.",
    )
    bodies: Literal["full", "none"] = Field(
        default="full",
        description="Whether recorded calls keep their request and response bodies (the harness's JSON, "
        "for replay and the export). none: only what training reads (token ids, log-probs, the call "
        "tree); the export's bodies are null and a Responses call naming previous_response_id is refused.",
    )


class GatewaySpec(SpecModel):
    model_config = _rules(
        _cel(
            f"self.replicas <= 1 || (has(self.store) && {_is_set('self.store.urlSecret')})",
            "replicas above 1 need store.urlSecret: SQLite on a ReadWriteOnce claim serves one gateway",
            field_path=".replicas",
            reason="FieldValueInvalid",
        )
    )

    image: str | None = Field(
        default=None, min_length=1, description="Gateway image; default: the operator's setting."
    )
    store: GatewayStore = Field(
        default_factory=GatewayStore, description="Where the gateway records rollouts and calls."
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=32,
        validate_default=True,
        description="Gateway pods (Deployment replicas) behind the run's Service. Above 1 only with "
        "store.urlSecret: the pods share the PostgreSQL database.",
    )
    pod: PodOverrides | None = Field(
        default=None,
        description="Overrides of the gateway pod; resources merge over the defaults "
        f"({_shown(GATEWAY_RESOURCES)}).",
    )

    @field_validator("replicas")
    @classmethod
    def _replicas_need_a_shared_store(cls, replicas: int, info: ValidationInfo) -> int:
        store = info.data.get("store")
        if replicas > 1 and isinstance(store, GatewayStore) and store.url_secret is None:
            raise _spec_error(
                "replicas above 1 need store.urlSecret (got {got} with the SQLite store): SQLite on a "
                "ReadWriteOnce claim serves one gateway",
                got=replicas,
            )
        return replicas


class VllmSettings(SpecModel):
    """verl's rollout settings for vLLM servers that share the trainer's GPUs (`inference: vllm`)."""

    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0.0,
        le=0.95,
        description="Fraction of each GPU's memory vLLM takes for weights and KV cache while it serves; "
        "it gives both back while the policy trains (vLLM's sleep mode).",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="GPUs per vLLM server; trainer GPUs must be a multiple of it."
    )
    max_model_len: int = Field(
        default=8192,
        ge=64,
        le=1_048_576,
        description="Longest prompt plus reply a vLLM server accepts, in tokens.",
    )


class TrainerSpec(SpecModel):
    model_config = _rules(
        _cel(
            "self.nodes <= 1 || self.engine == 'verl'",
            "nodes above 1 need engine verl: the torch engine trains in one pod",
            field_path=".nodes",
            reason="FieldValueInvalid",
        ),
        _cel(
            "self.inference != 'vllm' || (self.engine == 'verl' && self.gpus >= 1)",
            "inference vllm needs engine verl and gpus of at least 1: verl starts the vLLM servers on "
            "the trainer's GPUs",
            field_path=".inference",
            reason="FieldValueInvalid",
        ),
        _cel(
            "self.inference != 'vllm' || !has(self.vllm) || !has(self.vllm.tensorParallelSize) "
            "|| self.gpus % self.vllm.tensorParallelSize == 0",
            "gpus must be a multiple of vllm.tensorParallelSize",
            field_path=".vllm.tensorParallelSize",
            reason="FieldValueInvalid",
        ),
    )

    engine: Literal["torch", "verl"] = Field(
        default="torch",
        description="torch: the built-in engine (one process; the fastest on a few CPU cores). verl: "
        "verl's FSDP workers on a Ray cluster (GPUs, or CPU through inharness's platform module).",
    )
    image: str | None = Field(
        default=None, min_length=1, description="Trainer image; default: the operator's setting."
    )
    gpus: int = Field(
        default=1, ge=0, le=64, description="GPUs of each trainer pod (nvidia.com/gpu): of each Ray node."
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        validate_default=True,
        description="Trainer pods (StatefulSet replicas). With engine verl they form one Ray cluster of "
        "this many nodes: pod 0 is the head and runs the training, the others join it and hold their "
        "gpus for verl's workers. Above 1 only with engine verl.",
    )
    shm_size: str = Field(
        default="8Gi",
        min_length=1,
        pattern=_QUANTITY,
        description="Size of /dev/shm (a memory emptyDir) of each trainer pod; with engine verl, half of "
        "it is Ray's object store.",
    )
    inference: Literal["engine", "vllm"] = Field(
        default="engine",
        description="What answers the gateway's calls. engine: inharness's inference server in the "
        "trainer pod, which loads each version from a model directory (CPU, or one GPU). vllm: vLLM "
        "servers that verl starts on the trainer's GPUs (engine verl, gpus >= 1), sharing them with "
        "training: they sleep while the policy trains and take each version's weights in place; the "
        "gateway learns their addresses per version. scheduling.mode sync or collocated-async.",
    )
    vllm: VllmSettings = Field(
        default_factory=VllmSettings, description="The vLLM servers' settings (inference vllm)."
    )
    pod: PodOverrides | None = Field(
        default=None,
        description="Overrides of the trainer pod; resources merge over the defaults: with gpus 0 "
        f"{_shown(TRAINER_CPU_RESOURCES)}; with GPUs, per GPU, {_TRAINER_PER_GPU} (and nvidia.com/gpu as a "
        "limit). A request above a default limit raises that limit to it.",
    )

    @field_validator("nodes")
    @classmethod
    def _nodes_need_verl(cls, nodes: int, info: ValidationInfo) -> int:
        engine = info.data.get("engine")
        if nodes > 1 and engine not in (None, "verl"):
            raise _spec_error(
                "nodes above 1 need engine verl (got {got} with engine {engine}): the torch engine "
                "trains in one pod",
                got=nodes,
                engine=engine,
            )
        return nodes

    @model_validator(mode="after")
    def _vllm_needs_verl_on_gpus(self) -> "TrainerSpec":
        if self.inference == "vllm" and (self.engine != "verl" or self.gpus < 1):
            raise _spec_error(
                "inference vllm needs engine verl and gpus of at least 1 (got engine {engine}, gpus "
                "{gpus}): verl starts the vLLM servers on the trainer's GPUs",
                engine=self.engine,
                gpus=self.gpus,
            )
        if self.inference == "vllm" and self.gpus % self.vllm.tensor_parallel_size:
            raise _spec_error(
                "gpus ({gpus}) must be a multiple of vllm.tensorParallelSize ({tp})",
                gpus=self.gpus,
                tp=self.vllm.tensor_parallel_size,
            )
        return self


_FROZEN_CONTEXT_NEEDS_TORCH = (
    "algorithm.contextGradient false needs trainer.engine torch: verl's actor takes the full backward"
)


class TrainingRunSpec(SpecModel):
    model_config = _rules(
        _cel(
            "!has(self.trainer) || self.trainer.inference != 'vllm' || !has(self.scheduling) "
            "|| self.scheduling.mode != 'async'",
            "scheduling.mode async needs inference engines of their own; with trainer.inference vllm "
            "they share the trainer's GPUs: use sync or collocated-async",
            field_path=".scheduling.mode",
            reason="FieldValueInvalid",
        ),
        _cel(
            "!has(self.trainer) || self.trainer.engine != 'verl' || !has(self.algorithm) "
            "|| self.algorithm.contextGradient",
            _FROZEN_CONTEXT_NEEDS_TORCH,
            field_path=".algorithm.contextGradient",
            reason="FieldValueInvalid",
        ),
    )

    model: PolicyModel = Field(description="The policy to train.")
    dataset: Dataset = Field(description="Tasks to train on.")
    rollout_pool_ref: ObjectRef = Field(description="The RolloutPool that runs this run's rollouts.")
    algorithm: Algorithm = Field(default_factory=Algorithm, description="RL algorithm and its settings.")
    batch_size: int = Field(default=8, ge=1, le=100_000, description="Tasks per training step.")
    steps: int = Field(default=10, ge=1, le=10_000_000, description="Training steps.")
    scheduling: Scheduling = Field(
        default_factory=Scheduling, description="How rollouts and updates interleave."
    )
    generation: Generation = Field(default_factory=Generation, description="Sampling of the policy.")
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="Checkpointing.")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed for task order and initialization.")
    suspend: bool = Field(
        default=False,
        description="Scale the gateway and trainer to zero, keeping their state; false resumes.",
    )
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="The run's gateway on a cluster.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="The run's trainer on a cluster.")

    @model_validator(mode="after")
    def _vllm_shares_devices(self) -> "TrainingRunSpec":
        if self.trainer.inference == "vllm" and self.scheduling.mode == "async":
            raise _spec_error(
                "scheduling.mode async needs inference engines of their own; with trainer.inference "
                "vllm they share the trainer's GPUs: use sync or collocated-async"
            )
        if self.trainer.engine == "verl" and not self.algorithm.context_gradient:
            raise _spec_error(_FROZEN_CONTEXT_NEEDS_TORCH)
        return self


_STARTED = f"has(oldSelf.status) && {_is_set('oldSelf.status.startTime')}"


class TrainingRun(SpecModel):
    """status stays free-form here (local runs ignore it; a status exported from a cluster running
    another version still loads); the operator writes it through status_model, which is also the
    CRD's status schema.

    The immutability rules are transition rules at the root of the object, the one place where a
    rule sees both the spec and the old status: a run has started once its status has a startTime."""

    model_config = _rules(
        _cel(
            f"!({_STARTED}) || self.spec.model == oldSelf.spec.model",
            "spec.model cannot change once the run has started (status.startTime is set); "
            "create a new TrainingRun instead",
            field_path=".spec.model",
            reason="FieldValueForbidden",
        ),
        _cel(
            f"!({_STARTED}) || self.spec.rolloutPoolRef == oldSelf.spec.rolloutPoolRef",
            "spec.rolloutPoolRef cannot change once the run has started (status.startTime is set); "
            "create a new TrainingRun instead",
            field_path=".spec.rolloutPoolRef",
            reason="FieldValueForbidden",
        ),
    )

    status_model: ClassVar[type[SpecModel] | None] = TrainingRunStatus

    api_version: Literal[API_VERSION] = Field(description=f"Always {API_VERSION}.")
    kind: Literal["TrainingRun"] = Field(description="Always TrainingRun.")
    metadata: ObjectMeta = Field(description="Name and Kubernetes metadata.")
    spec: TrainingRunSpec = Field(description="What to train, on what, and how.")
    status: dict[str, Any] | None = Field(default=None, description="Written by the operator.")


Resource = TrainingRun | RolloutPool | HarnessSpec
KINDS: dict[str, type[TrainingRun] | type[RolloutPool] | type[HarnessSpec]] = {
    "TrainingRun": TrainingRun,
    "RolloutPool": RolloutPool,
    "HarnessSpec": HarnessSpec,
}

# RolloutPoolSpec names KubernetesPool, which needs PodOverrides, defined with the TrainingRun's pieces,
# and LocalPool beside it.
RolloutPoolSpec.model_rebuild()
RolloutPool.model_rebuild()
