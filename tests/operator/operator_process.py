"""The real `inharness operator run` as a subprocess against an emulated cluster, for the tests that
drive it from outside (test_operator_emulator.py, test_kubectl_flow.py)."""

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from testsupport import eventually

from inharness.procs import free_port


@dataclass
class Operator:
    proc: asyncio.subprocess.Process
    metrics_url: str
    log: Path


@contextlib.asynccontextmanager
async def operator_running(
    kubeconfig: Path, log: Path, *, namespace: str, gateway_url: str, resync_seconds: float = 1.0
) -> AsyncIterator[Operator]:
    """Start the operator watching `namespace`, wait for its liveness probe, and stop it (SIGTERM,
    then SIGKILL after 20 s) on exit; its log must hold no traceback."""
    metrics, liveness = free_port(), free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "INHARNESS_GATEWAY_IMAGE": "example.org/inharness:test",
        "INHARNESS_TRAINER_IMAGE": "example.org/trainer:test",
    }
    args = ["operator", "run", "--namespace", namespace, "--metrics-port", str(metrics)]
    args += ["--liveness-port", str(liveness), "--resync-seconds", str(resync_seconds)]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "inharness.cli",
            *args,
            "--gateway-url",
            gateway_url,
            env=env,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        async def alive() -> bool:
            if proc.returncode is not None:
                pytest.fail(f"operator exited with {proc.returncode}:\n{_tail(log)}")
            try:
                async with httpx.AsyncClient(timeout=1) as h:
                    return (await h.get(f"http://127.0.0.1:{liveness}/healthz")).status_code == 200
            except httpx.HTTPError:
                return False

        await eventually(alive, "the operator answers its liveness probe", within=60)
        yield Operator(proc, f"http://127.0.0.1:{metrics}/metrics", log)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        text = _text(log)
        assert "Traceback" not in text, text[-4000:]


def _text(log: Path) -> str:
    return log.read_text(errors="replace")


def _tail(log: Path) -> str:
    return _text(log)[-4000:]
