"""Settings of one gateway process; every field is a flag of `inharness gateway` and an env var."""

from typing import Literal

from pydantic import BaseModel, Field


class GatewaySettings(BaseModel):
    model: str = Field(
        description="model directory: the tokenizer and chat template the gateway renders with"
    )
    engines: list[str] = Field(default_factory=list, description="engine base URLs of the initial version")
    model_version: int = Field(default=0, ge=0, description="version the --engine URLs are registered under")
    store: str = "sqlite:///inharness-gateway.db"
    sqlite_synchronous: Literal["normal", "full"] = Field(
        default="normal",
        description="normal: every answered call survives a killed gateway; full: also a power loss (fsync)",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    admin_token: str = Field(min_length=8, description="bearer token of the control API")
    served_model_name: str | None = None
    max_model_len: int | None = Field(default=None, ge=16)
    max_attempts: int = Field(default=3, ge=1, le=100, description="attempts per rollout unless a batch says")
    hold_seconds: float = Field(default=120.0, gt=0, description="a serving pause ends by itself after this")
    lease_sweep_seconds: float = Field(default=1.0, gt=0)
    engine_retries: int = Field(default=3, ge=0, le=20)
    engine_timeout_seconds: float = Field(default=600.0, gt=0)
