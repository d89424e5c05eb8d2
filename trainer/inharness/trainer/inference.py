"""Inference: what answers the gateway's calls, and how a new version of the policy gets there.

The training loop sees one seam, whatever runs the model (``spec.trainer.inference``):

- `EngineServers` (``engine``): inharness's inference servers, each loading a version from the model
  directory the policy writes (``/v1/inharness/load_weights``); they keep their own device.
- `inharness.trainer.verl_engine.servers.VllmServers` (``vllm``): vLLM servers that verl starts on the
  training GPUs; they give the GPUs back while the policy trains and take each version's weights in
  place.

Either way the gateway learns the servers' addresses per version (``POST /api/v1/models/versions``), so
no harness knows which runs.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol

import aiohttp


class Inference(Protocol):
    """``shares_devices``: inference runs on the devices the policy trains on, so the loop holds the
    gateway's calls for the whole update and `release` frees the devices first."""

    shares_devices: bool

    def urls(self) -> list[str]:
        """The servers' base URLs, as the gateway dials them, of the version now served."""
        ...

    async def release(self) -> None:
        """Before an update (calls are held, none in flight): free what inference holds on the devices."""
        ...

    async def publish(self, version: int) -> None:
        """The policy's current weights served as `version` by every server (calls are held)."""
        ...


class _SavesWeights(Protocol):
    def save_pretrained(self, out_dir: Path) -> Path: ...


class EngineServers:
    """inharness engines (``inharness engine``) that load each version from ``<weights>/v<version>``.

    An engine that cannot be reached is waited for (up to `wait_seconds`: a supervisor may be
    restarting it), one that refuses is an error. With an engine API key the request carries it
    (`inharness.engine.auth`); the engine takes only paths under its weights root, which `inharness
    train` sets to `weights`."""

    shares_devices = False

    def __init__(
        self,
        policy: _SavesWeights,
        urls: list[str],
        weights: Path,
        *,
        wait_seconds: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        self.policy = policy
        self._urls = urls
        self.weights = weights
        self.wait_seconds = wait_seconds
        self._auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}

    def urls(self) -> list[str]:
        return list(self._urls)

    async def release(self) -> None:
        return None

    async def publish(self, version: int) -> None:
        path = await asyncio.to_thread(self.policy.save_pretrained, self.weights / f"v{version}")
        for url in self._urls:
            await self._load(url, path, version)

    async def _load(self, url: str, path: Path, version: int) -> None:
        deadline = time.monotonic() + self.wait_seconds
        delay = 0.2
        load = {"path": str(path)}
        while True:
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(f"{url}/v1/inharness/load_weights", json=load, headers=self._auth) as r,
                ):
                    if r.status != 200:
                        raise RuntimeError(
                            f"engine {url} refused the weights of version {version}: {await r.text()}"
                        )
                    return
            except aiohttp.ClientConnectionError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine {url} unreachable while loading version {version}: {exc}"
                    ) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
