"""The serving gate holds new calls while paused and lets running ones finish."""

import asyncio
import time

from inharness.gateway.serving import ServingGate


async def test_pause_holds_new_calls_until_resume() -> None:
    gate = ServingGate(default_hold_seconds=60)
    gate.hold_until(time.time() + gate.hold_seconds(None))
    admitted = asyncio.Event()

    async def call() -> None:
        async with gate.admit():
            admitted.set()

    task = asyncio.create_task(call())
    for _ in range(100):
        if gate.held == 1:
            break
        await asyncio.sleep(0)
    assert gate.state().held == 1 and not admitted.is_set()
    gate.resume()
    await asyncio.wait_for(task, 5)
    assert admitted.is_set() and gate.state().paused is False


async def test_pause_ends_by_itself_after_the_hold_timeout() -> None:
    gate = ServingGate(default_hold_seconds=60)
    gate.hold_until(time.time() + gate.hold_seconds(0.05))

    async def call() -> None:
        async with gate.admit():
            pass

    await asyncio.wait_for(call(), 5)
    assert gate.state().paused is False


async def test_pause_drains_in_flight_calls() -> None:
    gate = ServingGate(default_hold_seconds=60)
    release, started = asyncio.Event(), asyncio.Event()

    async def running() -> None:
        async with gate.admit():
            started.set()
            await release.wait()

    task = asyncio.create_task(running())
    await started.wait()
    asyncio.get_running_loop().call_soon(release.set)
    gate.hold_until(time.time() + gate.hold_seconds(None))
    await gate.drain(5)
    state = gate.state()
    await task
    assert state.paused and state.in_flight == 0


async def test_a_pause_from_the_store_whose_time_has_passed_does_not_close_the_gate() -> None:
    """Another process's pause that ended by its hold timeout is still in the store as paused; applying
    it must not close the gate for a moment on every poll."""
    gate = ServingGate(default_hold_seconds=60)
    gate.apply(holding=True, resumes_at=time.time() - 1, generation=3)
    assert gate.state().paused is False and gate.generation == 3
    gate.apply(holding=True, resumes_at=time.time() + 60, generation=4)
    assert gate.state().paused is True
