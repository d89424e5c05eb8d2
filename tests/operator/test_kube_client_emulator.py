"""Our Kubernetes API client against kmock's emulator on 127.0.0.1: verbs, errors, list pages
with kinds, watch events, credentials from KUBECONFIG, request counting and pacing."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from kmock import Server
from kube_emulator import EmulatedCluster

from inharness.operator import kube as kube_module
from inharness.operator.kube import (
    CONFIGMAPS,
    TRAININGRUNS,
    AlreadyExists,
    KubeClient,
    NotFound,
    Resource,
)


@pytest.fixture
async def emulator() -> AsyncIterator[tuple[EmulatedCluster, str]]:
    async with EmulatedCluster() as k8s, Server(k8s) as server:
        yield k8s, str(server.url).rstrip("/")


def configmap(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "1"}}


async def test_emulator_client_creates_gets_patches_lists_and_deletes(
    emulator: tuple[EmulatedCluster, str],
) -> None:
    _, url = emulator
    async with KubeClient(url, "t") as kube:
        created = await kube.create(CONFIGMAPS, configmap("one"), "ns")
        assert created["metadata"]["uid"] and created["metadata"]["namespace"] == "ns"
        with pytest.raises(AlreadyExists):
            await kube.create(CONFIGMAPS, configmap("one"), "ns")
        patched = await kube.patch(CONFIGMAPS, "one", {"data": {"b": "2", "a": None}}, "ns")
        assert patched["data"] == {"b": "2"}  # merge patch: null deletes
        assert (await kube.get(CONFIGMAPS, "one", "ns"))["data"] == {"b": "2"}
        await kube.create(CONFIGMAPS, configmap("two"), "ns")
        listed = await kube.list(CONFIGMAPS, "ns")
        assert sorted(o["metadata"]["name"] for o in listed) == ["one", "two"]
        assert all(o["kind"] == "ConfigMap" and o["apiVersion"] == "v1" for o in listed)
        await kube.delete(CONFIGMAPS, "one", "ns")
        with pytest.raises(NotFound):
            await kube.get(CONFIGMAPS, "one", "ns")
        assert kube.requests["create"] == 3 and kube.requests["get"] == 2 and kube.requests["list"] == 1


async def test_emulator_client_watch_yields_typed_events(emulator: tuple[EmulatedCluster, str]) -> None:
    _, url = emulator
    async with KubeClient(url) as kube:
        await kube.create(CONFIGMAPS, configmap("before"), "ns")
        seen: list[tuple[str, str]] = []
        started = asyncio.Event()

        async def watch() -> None:
            async for kind, obj in kube.watch(CONFIGMAPS, "ns"):
                seen.append((kind, obj["metadata"]["name"]))
                started.set()
                if kind == "DELETED":
                    return

        task = asyncio.create_task(watch())
        await asyncio.wait_for(started.wait(), 10)
        await kube.create(CONFIGMAPS, configmap("after"), "ns")
        await kube.delete(CONFIGMAPS, "after", "ns")
        await asyncio.wait_for(task, 10)
        assert seen == [("ADDED", "before"), ("ADDED", "after"), ("DELETED", "after")]


async def test_emulator_client_reads_kubeconfig(
    emulator: tuple[EmulatedCluster, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k8s, url = emulator
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(k8s.kubeconfig(tmp_path / "config", url)))
    async with KubeClient.from_environment() as kube:
        assert kube.credentials is None  # nothing loaded before the first request
        assert await kube.list(TRAININGRUNS, "ns") == []
        assert kube.credentials is not None and kube.credentials.server == url
        assert kube.credentials.authorization == "Bearer emulator-token"
    assert [r.headers.get("Authorization") for r in k8s] == ["Bearer emulator-token"]


class VirtualClock:
    """The client's clock in virtual time: `monotonic` stands still until the token bucket sleeps, and each
    sleep moves it on by exactly its delay and is recorded with the requests `sent()` so far."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[tuple[int, float]] = []
        self.sent: Callable[[], int] = lambda: 0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append((self.sent(), delay))
        self.now += delay
        await asyncio.sleep(0)


async def test_client_side_rate_limit_paces_requests_beyond_the_burst(
    emulator: tuple[EmulatedCluster, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`burst` requests go out without waiting; each one after them waits 1/qps for a token. On a virtual
    clock, so the waits are exact whatever the machine's load (real request rates are bench/'s business)."""
    _, url = emulator
    clock = VirtualClock()
    monkeypatch.setattr(kube_module, "time", SimpleNamespace(**{**vars(time), "monotonic": clock.monotonic}))
    monkeypatch.setattr(kube_module, "asyncio", SimpleNamespace(**{**vars(asyncio), "sleep": clock.sleep}))
    async with KubeClient(url, qps=8, burst=2) as kube:
        clock.sent = lambda: kube.requests["get"]
        for _ in range(6):
            with pytest.raises(NotFound):  # each one reached the emulator
                await kube.get(CONFIGMAPS, "absent", "ns")
        assert kube.requests["get"] == 6
    # No wait while the burst lasts, then one token (1/8 s, exact in binary) before each later request.
    assert clock.sleeps == [(2, 0.125), (3, 0.125), (4, 0.125), (5, 0.125)]
    assert clock.now == 0.5


def test_resource_paths() -> None:
    assert (
        TRAININGRUNS.path("ns", "r", "status")
        == "/apis/inharness.dev/v1alpha1/namespaces/ns/trainingruns/r/status"
    )
    assert CONFIGMAPS.path(None) == "/api/v1/configmaps"
    assert Resource("", "v1", "namespaces", namespaced=False).path("ignored", "x") == "/api/v1/namespaces/x"
