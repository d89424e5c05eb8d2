"""`inharness operator run`: the kopf operator for TrainingRun and RolloutPool.

kopf settings, and why:
- Our own names: finalizer `inharness.dev/finalizer` (used only by handlers that need one: none
  for TrainingRun) and kopf's progress/diffbase annotations under `inharness.dev/`.
- Standalone (no peering objects): the chart runs one replica with the Recreate strategy.
- No dynamic scanning of namespaces and CRDs: namespaces are exact names (or all of them), CRDs
  are installed with the chart before the operator starts, and the operator then needs no RBAC
  to list namespaces or CRDs (least privilege).
- kopf's own log messages become Kubernetes Events only from WARNING up; our phase changes and
  errors are posted as Events by the handlers.
- Watches time out on the server after 5 minutes and are re-established, so a silently dropped
  connection cannot leave the operator blind for long.

Prometheus metrics on --metrics-port (/metrics), kopf's liveness probe on --liveness-port
(/healthz), and the resync loop that re-converges every run every --resync-seconds.
"""

import asyncio
import contextlib
import logging
import os
from typing import Any

import kopf
from prometheus_client import start_http_server
from pydantic import BaseModel, Field, model_validator

from inharness.operator import pools, render, trainingruns
from inharness.operator.api import GROUP
from inharness.operator.events import EventRecorder
from inharness.operator.kube import KubeClient
from inharness.operator.metrics import OperatorMetrics
from inharness.operator.render import RenderSettings

log = logging.getLogger("inharness.operator")

PREFIX = GROUP
FINALIZER = f"{GROUP}/finalizer"


class OperatorConfig(BaseModel):
    """The flags of `inharness operator run`."""

    namespaces: list[str] = Field(default_factory=list, description="Namespaces to watch.")
    all_namespaces: bool = Field(default=False, description="Watch every namespace.")
    metrics_port: int = Field(default=8080, ge=1, le=65535)
    liveness_port: int = Field(default=8081, ge=1, le=65535)
    bind: str = Field(default="0.0.0.0", description="Address the metrics and liveness servers bind.")
    resync_seconds: float = Field(default=30.0, gt=0, le=3600)
    gateway_url: str = Field(
        default=render.GATEWAY_URL_TEMPLATE,
        description="URL of a run's gateway; {name} and {namespace} are the TrainingRun's.",
    )

    @model_validator(mode="after")
    def _where(self) -> "OperatorConfig":
        if bool(self.namespaces) == self.all_namespaces:
            raise ValueError("give --namespace NS (repeatable) or --all-namespaces, not both or neither")
        return self


def kopf_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = True
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "inharness-operator"
    settings.posting.event_name_prefix = "inharness-operator-"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    return settings


class _State(BaseModel):
    """What `run` hands to the startup handler through kopf's memo."""

    model_config = {"arbitrary_types_allowed": True}
    config: OperatorConfig
    metrics: OperatorMetrics


@kopf.on.startup()
async def _startup(memo: kopf.Memo, **_: Any) -> None:
    state: _State = memo.state
    kube = KubeClient.from_environment()
    memo.kube = kube
    memo.trainingruns = trainingruns.Context(
        kube=kube,
        settings=RenderSettings.from_env(),
        events=EventRecorder(kube),
        metrics=state.metrics,
        gateway_url=state.config.gateway_url,
        resync_seconds=state.config.resync_seconds,
    )
    namespaces = None if state.config.all_namespaces else state.config.namespaces
    memo.resync = asyncio.create_task(
        trainingruns.resync_forever(memo.trainingruns, namespaces), name="trainingrun-resync"
    )
    memo.pools = pools.PoolManager(
        kube,
        memo.trainingruns.events,
        state.metrics,
        gateway_url=state.config.gateway_url,
        namespaces=namespaces,
        interval=min(state.config.resync_seconds, 5.0),
    )
    memo.pool_sync = asyncio.create_task(memo.pools.run_forever(), name="rolloutpool-sync")


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    for name in ("resync", "pool_sync"):
        task: asyncio.Task[None] | None = getattr(memo, name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    manager: pools.PoolManager | None = getattr(memo, "pools", None)
    if manager is not None:
        await manager.close()  # harness pods run on: the next operator adopts them
    kube: KubeClient | None = getattr(memo, "kube", None)
    if kube is not None:
        await kube.aclose()


def run(config: OperatorConfig) -> int:
    logging.basicConfig(
        level=os.environ.get("INHARNESS_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    metrics = OperatorMetrics()
    start_http_server(config.metrics_port, addr=config.bind, registry=metrics.registry)
    kopf.run(
        settings=kopf_settings(),
        standalone=True,
        clusterwide=config.all_namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=f"http://{config.bind}:{config.liveness_port}/healthz",
        memo=kopf.Memo(state=_State(config=config, metrics=metrics)),
    )
    return 0
