"""Settings of one gateway process; every field is a flag of `inharness gateway` and an env var.

Secrets come as values or as files (a mounted Secret's items, which no `kubectl describe` of the pod
shows): the admin token as `admin_token` or `admin_token_file` (exactly one; the file is read here,
so the rest of the gateway sees `admin_token`), the engines' API key only as `engine_api_key_file`.
"""

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

DEFAULT_PORT = 8000


class GatewaySettings(BaseModel):
    model: str = Field(
        description="model directory: the tokenizer and chat template the gateway renders with"
    )
    engines: list[str] = Field(default_factory=list, description="engine base URLs of the initial version")
    model_version: int = Field(default=0, ge=0, description="version the --engine URLs are registered under")
    store: str = Field(
        default="sqlite:///inharness-gateway.db",
        description="the store's database URL: sqlite:///PATH (one gateway process), or "
        "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (several; pass it as an env var, not a flag, "
        "to keep the password out of the process list); migrated on start",
    )
    sqlite_synchronous: Literal["normal", "full"] = Field(
        default="normal",
        description="normal: every answered call survives a killed gateway; full: also a power loss (fsync)",
    )
    bodies: Literal["full", "none"] = Field(
        default="full",
        description="full: every call keeps its request and response bodies (the export's request and "
        "response, Responses' previous_response_id); none: only what training reads (token ids, "
        "log-probs, the call tree), for a run that needs no replay",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="gateway processes listening on the one port (SO_REUSEPORT); more than 1 needs a "
        "PostgreSQL store, through which they share the serving pause, model versions and progress",
    )
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="port to listen on")
    admin_token: str = Field(min_length=8, description="bearer token of the control API")
    admin_token_file: str | None = Field(
        default=None, description="file holding the admin token (instead of --admin-token)"
    )
    engine_api_key_file: str | None = Field(
        default=None,
        description="file holding the engines' API key, sent as 'Authorization: Bearer' (none: no key)",
    )
    served_model_name: str | None = Field(
        default=None, description="the model name /v1/models lists (default: the model directory's name)"
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="context length (default: the model config's max_position_embeddings)",
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        le=2,
        description="the policy's sampling temperature, used for every call whatever temperature the "
        "harness asks (a TrainingRun's spec.generation.temperature, at which the trainer scores the "
        "samples); none: the harness's own",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="most tokens generated per call: a harness asking more, or nothing, gets this many "
        "at most (a TrainingRun's spec.generation.maxTokens); none: the context left",
    )
    max_attempts: int = Field(default=3, ge=1, le=100, description="attempts per rollout unless a batch says")
    hold_seconds: float = Field(default=120.0, gt=0, description="a serving pause ends by itself after this")
    lease_sweep_seconds: float = Field(default=1.0, gt=0, description="how often expired leases are requeued")
    engine_retries: int = Field(default=3, ge=0, le=20, description="retries of a failed engine request")
    engine_timeout_seconds: float = Field(default=600.0, gt=0, description="timeout of one engine request")
    max_request_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="largest request body taken (a larger one is answered 413 unread): a 128k-token "
        "conversation with its tool schemas fits the default",
    )
    request_read_timeout_seconds: float = Field(
        default=60.0, gt=0, description="a request body not received in full within this is answered 408"
    )
    request_head_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="a request's line and headers not received in full within this are answered 408 "
        "and the connection closed: a client that dribbles them holds no connection for longer",
    )
    request_head_max_bytes: int = Field(
        default=65536,
        ge=1024,
        description="a request's line and headers above this are answered 431 and the connection closed",
    )

    @field_validator("store")
    @classmethod
    def _store_url_supported(cls, url: str) -> str:
        """A URL the store cannot open fails here, at start; the message never repeats the URL, which
        may hold a password."""
        from inharness.gateway.store.base import StoreError
        from inharness.gateway.store.store import store_url

        try:
            store_url(url)
        except StoreError as exc:
            raise ValueError(str(exc)) from None
        return url

    @model_validator(mode="before")
    @classmethod
    def _admin_token_from_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("admin_token_file") is None:
            return data
        if data.get("admin_token") is not None:
            raise ValueError("give exactly one of admin_token and admin_token_file")
        return {**data, "admin_token": _read_secret(str(data["admin_token_file"]))}

    @model_validator(mode="after")
    def _workers_share_a_database(self) -> "GatewaySettings":
        """A SQLite store serialises its writers inside one process only: several would fail each other."""
        if self.workers > 1 and not self.store.startswith("postgresql"):
            raise ValueError(
                "--workers above 1 needs a PostgreSQL store (--store postgresql://...): "
                "a SQLite store takes one gateway process"
            )
        return self

    @model_validator(mode="after")
    def _engine_api_key_readable(self) -> "GatewaySettings":
        self.engine_api_key()  # a missing or empty file fails at start, not at the first call
        return self

    def engine_api_key(self) -> str | None:
        """The engines' API key, read from `engine_api_key_file` (None: the engines need none)."""
        return None if self.engine_api_key_file is None else _read_secret(self.engine_api_key_file)


def _read_secret(path: str) -> str:
    """A secret's file without surrounding whitespace, or a ValueError (a validation error) saying why not."""
    from inharness.engine.auth import AuthError, read_key_file  # the engine's reader, without torch

    try:
        return read_key_file(path)
    except AuthError as exc:
        raise ValueError(str(exc)) from None
