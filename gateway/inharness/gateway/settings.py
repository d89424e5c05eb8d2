"""Settings of one gateway process; every field is a flag of `inharness gateway` and an env var."""

from typing import Literal

from pydantic import BaseModel, Field

DEFAULT_PORT = 8000


class GatewaySettings(BaseModel):
    model: str = Field(
        description="model directory: the tokenizer and chat template the gateway renders with"
    )
    engines: list[str] = Field(default_factory=list, description="engine base URLs of the initial version")
    model_version: int = Field(default=0, ge=0, description="version the --engine URLs are registered under")
    store: str = Field(default="sqlite:///inharness-gateway.db", description="the store's database URL")
    sqlite_synchronous: Literal["normal", "full"] = Field(
        default="normal",
        description="normal: every answered call survives a killed gateway; full: also a power loss (fsync)",
    )
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="port to listen on")
    admin_token: str = Field(min_length=8, description="bearer token of the control API")
    served_model_name: str | None = Field(
        default=None, description="the model name /v1/models lists (default: the model directory's name)"
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        description="context length (default: the model config's max_position_embeddings)",
    )
    max_attempts: int = Field(default=3, ge=1, le=100, description="attempts per rollout unless a batch says")
    hold_seconds: float = Field(default=120.0, gt=0, description="a serving pause ends by itself after this")
    lease_sweep_seconds: float = Field(default=1.0, gt=0, description="how often expired leases are requeued")
    engine_retries: int = Field(default=3, ge=0, le=20, description="retries of a failed engine request")
    engine_timeout_seconds: float = Field(default=600.0, gt=0, description="timeout of one engine request")
