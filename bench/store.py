"""What the gateway store writes per call of one long conversation, against the turn number: bytes of
token ids stored and the time to record the call, and the time to read the conversation back.

Each call's prompt is the whole conversation so far, as the gateway builds it: the parent call's
prompt and response, then the new turn's ids. Two ways of storing it, side by side in one run on the
same store:
- `whole`: every prompt stored whole (the store before migration 6; still the way for a call that
  extends nothing): bytes per call grow with the turn, the conversation's total with its square;
- `continuation`: a continuation (`prefix_reused`) stored as its new ids after the parent's
  (`calls.prompt_prefix`): bytes per call stay flat, the total grows with the conversation.
Reads rebuild the whole prompts either way (`list_calls`, the export, the parent lookup).

Only the id blobs are counted (prompt, response, logprobs). The request bodies the gateway also keeps
(the harness's JSON, for replay) still hold each request's whole history; this benchmark sends empty
bodies to measure the ids alone.

Workload: `--turns` 50, a first context of `--context` 8,000 tokens, each turn adding `--turn-tokens`
300 (a tool's output) after a 200-token response; `--repeats` conversations per way (median per turn).

Run: make bench-store   (or: .venv/bin/python bench/store.py [--turns 50] [--context 8000]
     [--store postgresql://USER:PASSWORD@HOST:PORT/DATABASE]; default: a SQLite file in a temp folder)
"""

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Store
from inharness.gateway.store.store import store_url

RESPONSE = 200


def _record(
    attempt: schema.ClaimedAttempt, turn: int, prompt: list[int], parent: CallRecord | None, *, reused: bool
) -> CallRecord:
    now = time.time()
    return CallRecord(
        attempt_id=attempt.id,
        rollout_id=attempt.rollout_id,
        request_id=f"{attempt.id}-{turn}",
        choice_index=0,
        protocol="openai.chat",
        requested_model="m",
        model_version=0,
        engine="e",
        prompt_ids=prompt,
        response_ids=[(turn * 7919 + i) % 150_000 for i in range(RESPONSE)],
        response_logprobs=[-0.25] * RESPONSE,
        finish_reason="stop",
        parent_call_id=None if parent is None else parent.id,
        prefix_reused=parent is not None and reused,
        prefix_mismatch=None,
        request_digest=f"q{attempt.id}{turn}",
        reply_digest=f"a{attempt.id}{turn}",
        started_at=now,
        first_token_at=None,
        finished_at=now,
        request_body={},
        response_body={},
    )


async def _conversation(
    store: Store, args: argparse.Namespace, *, reused: bool
) -> tuple[str, list[CallRecord], list[float]]:
    """One conversation recorded call by call: (attempt id, its calls, seconds to record each)."""
    await store.create_rollouts(schema.CreateRollouts(tasks=["bench"]), default_max_attempts=1)
    attempt = await store.claim("default", 3600)
    assert attempt is not None
    prompt = [(i * 31) % 150_000 for i in range(args.context)]
    records: list[CallRecord] = []
    seconds: list[float] = []
    for turn in range(args.turns):
        rec = _record(attempt, turn, prompt, records[-1] if records else None, reused=reused)
        start = time.perf_counter()
        await store.record_calls([rec])
        seconds.append(time.perf_counter() - start)
        records.append(rec)
        added = [(turn * 131 + i) % 150_000 for i in range(args.turn_tokens)]
        prompt = rec.prompt_ids + rec.response_ids + added
    return attempt.id, records, seconds


async def _stored_bytes(url: str, ids: list[int]) -> list[int]:
    """Bytes of each call's id blobs (prompt, response, logprobs) as the database holds them."""
    engine = create_async_engine(store_url(url))
    blobs = "length(prompt_ids) + length(response_ids) + length(response_logprobs)"
    try:
        async with engine.connect() as conn:
            size = {r[0]: int(r[1]) for r in await conn.execute(text(f"SELECT id, {blobs} FROM calls"))}
    finally:
        await engine.dispose()
    return [size[i] for i in ids]


async def _timed(read: Callable[[], Awaitable[object]], repeats: int = 5) -> float:
    """Median seconds of `repeats` runs of `read()`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await read()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _measure(
    store: Store, url: str, args: argparse.Namespace, *, reused: bool
) -> dict[str, list[float]]:
    sizes, writes = [], []
    for _ in range(args.repeats):
        attempt_id, records, seconds = await _conversation(store, args, reused=reused)
        sizes.append(await _stored_bytes(url, [r.id for r in records]))
        writes.append(seconds)
    listed = await store.list_calls(attempt_id, bodies=False)
    assert [c.prompt_ids for c in listed] == [r.prompt_ids for r in records], "a prompt read back differs"
    last = records[-1].reply_digest
    return {
        "prompt": [len(r.prompt_ids) for r in records],
        "bytes": [statistics.median(s[t] for s in sizes) for t in range(args.turns)],
        "write": [statistics.median(w[t] for w in writes) for t in range(args.turns)],
        "list": [await _timed(lambda: store.list_calls(attempt_id, bodies=False))],
        "parent": [await _timed(lambda: store.find_call_by_reply(attempt_id, [last]))],
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        url = args.store or f"sqlite:///{Path(tmp) / 'gateway.db'}"
        store = await Store.open(url)
        try:
            whole = await _measure(store, url, args, reused=False)
            cont = await _measure(store, url, args, reused=True)
        finally:
            await store.close()
    _print(whole, cont, args)


def _row(*cells: str) -> str:
    widths = (5, 10, 11, 11, 6, 14, 14, 6)
    out = [c.rjust(w) for c, w in zip(cells, widths, strict=True)]
    return " ".join(out[:2]) + " | " + " ".join(out[2:5]) + " | " + " ".join(out[5:])


def _print(whole: dict[str, list[float]], cont: dict[str, list[float]], args: argparse.Namespace) -> None:
    backend = "PostgreSQL" if args.store else "SQLite"
    print(
        f"{backend} store; {args.turns} turns, first context {args.context} tokens, +{args.turn_tokens} "
        f"per turn after a {RESPONSE}-token response; median of {args.repeats} conversations per way\n"
    )
    print(
        _row(
            "turn",
            "prompt ids",
            "bytes whole",
            "bytes cont.",
            "ratio",
            "write ms whole",
            "write ms cont.",
            "ratio",
        )
    )
    for turn in sorted({1, *range(10, args.turns + 1, 10), args.turns}):
        t = turn - 1
        bw, bc = whole["bytes"][t], cont["bytes"][t]
        ww, wc = whole["write"][t] * 1e3, cont["write"][t] * 1e3
        cells = (f"{bw:,.0f}", f"{bc:,.0f}", f"{bw / bc:.1f}", f"{ww:.2f}", f"{wc:.2f}", f"{ww / wc:.2f}")
        print(_row(str(turn), f"{whole['prompt'][t]:.0f}", *cells))
    bw, bc = sum(whole["bytes"]), sum(cont["bytes"])
    ww, wc = sum(whole["write"]) * 1e3, sum(cont["write"]) * 1e3
    print(
        _row(
            "all",
            "",
            f"{bw:,.0f}",
            f"{bc:,.0f}",
            f"{bw / bc:.1f}",
            f"{ww:.1f}",
            f"{wc:.1f}",
            f"{ww / wc:.2f}",
        )
    )
    lw, lc = whole["list"][0] * 1e3, cont["list"][0] * 1e3
    pw, pc = whole["parent"][0] * 1e3, cont["parent"][0] * 1e3
    print(
        f"\nread back (whole prompts): list_calls of the {args.turns} calls {lw:.1f} ms whole, {lc:.1f} ms "
        f"continuation ({lc / lw:.2f}x); the last call's parent lookup {pw:.2f} ms whole, {pc:.2f} ms "
        f"continuation ({pc / pw:.2f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--context", type=int, default=8000, help="tokens of the first prompt")
    parser.add_argument("--turn-tokens", type=int, default=300, help="tokens each turn adds after a response")
    parser.add_argument("--repeats", type=int, default=3, help="conversations per way")
    parser.add_argument("--store", help="a PostgreSQL URL (default: a SQLite file in a temp folder)")
    asyncio.run(main(parser.parse_args()))
