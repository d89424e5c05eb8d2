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

Beside the ids, the request and response bodies the gateway keeps (the harness's JSON, for replay and
the export): a Chat Completions conversation whose `messages` grow each turn by the previous reply (with
a tool call) and the tool's result, text sized like the tokens (4 characters a token). `body sent` is
the JSON the harness sent and got back; `body stored` what the store holds of it (`request_body` and
`response_body` as text, with `body_digest`): a call with a parent keeps only the messages after its
parent's (migration 8), in both ways, so it stays flat where the sent body grows. Reads rebuild the
whole bodies (`list_calls` with bodies, `call_bodies`) and are timed too.

Workload: `--turns` 50, a first context of `--context` 8,000 tokens, each turn adding `--turn-tokens`
300 (a tool's output) after a 200-token response; `--repeats` conversations per way (median per turn).

Run: make bench-store   (or: .venv/bin/python bench/store.py [--turns 50] [--context 8000]
     [--store postgresql://USER:PASSWORD@HOST:PORT/DATABASE]; default: a SQLite file in a temp folder)
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Store
from inharness.gateway.store.store import store_url

RESPONSE = 200
CHARS_PER_TOKEN = 4
_WORDS = [f"w{n:x}" for n in range(4096)]


def _text(tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens: seeded words, so a database cannot compress it away."""
    words = random.Random(seed).choices(_WORDS, k=tokens * CHARS_PER_TOKEN // 5 + 1)
    return " ".join(words)[: tokens * CHARS_PER_TOKEN]


def _reply(turn: int) -> dict[str, Any]:
    """The assistant's reply of `turn`: text and one tool call, about RESPONSE tokens."""
    call = {"id": f"call_{turn}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    return {"role": "assistant", "content": _text(RESPONSE - 10, turn), "tool_calls": [call]}


def _bodies(turn: int, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request body, response body) of the call at `turn`, asked with `messages`."""
    request = {"model": "m", "messages": messages, "tools": [_TOOL], "temperature": 1.0}
    choice = {"index": 0, "message": _reply(turn), "finish_reason": "tool_calls"}
    return request, {"id": f"chatcmpl-{turn}", "object": "chat.completion", "choices": [choice]}


_TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}


def _record(
    attempt: schema.ClaimedAttempt,
    turn: int,
    prompt: list[int],
    messages: list[dict[str, Any]],
    parent: CallRecord | None,
    *,
    reused: bool,
) -> CallRecord:
    now = time.time()
    request_body, response_body = _bodies(turn, messages)
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
        request_body=request_body,
        response_body=response_body,
    )


async def _conversation(
    store: Store, args: argparse.Namespace, *, reused: bool
) -> tuple[str, list[CallRecord], list[float]]:
    """One conversation recorded call by call: (attempt id, its calls, seconds to record each)."""
    await store.create_rollouts(schema.CreateRollouts(tasks=["bench"]), default_max_attempts=1)
    attempt = await store.claim("default", 3600)
    assert attempt is not None
    prompt = [(i * 31) % 150_000 for i in range(args.context)]
    messages = [
        {"role": "system", "content": "You are a careful agent with one tool."},
        {"role": "user", "content": _text(args.context, -1)},
    ]
    records: list[CallRecord] = []
    seconds: list[float] = []
    for turn in range(args.turns):
        rec = _record(attempt, turn, prompt, messages, records[-1] if records else None, reused=reused)
        start = time.perf_counter()
        await store.record_calls([rec])
        seconds.append(time.perf_counter() - start)
        records.append(rec)
        added = [(turn * 131 + i) % 150_000 for i in range(args.turn_tokens)]
        prompt = rec.prompt_ids + rec.response_ids + added
        result = {"role": "tool", "tool_call_id": f"call_{turn}", "content": _text(args.turn_tokens, turn)}
        messages = [*messages, _reply(turn), result]
    return attempt.id, records, seconds


async def _stored_bytes(url: str, ids: list[int]) -> tuple[list[int], list[int]]:
    """Bytes of each call's id blobs (prompt, response, logprobs), and of its bodies, as the database
    holds them (the bodies as uncompressed text)."""
    engine = create_async_engine(store_url(url))
    blobs = "length(prompt_ids) + length(response_ids) + length(response_logprobs)"
    sqlite = url.startswith("sqlite")
    size = "length(CAST({} AS BLOB))" if sqlite else "octet_length(CAST({} AS TEXT))"
    bodies = " + ".join(size.format(c) for c in ("request_body", "response_body"))
    bodies += " + COALESCE(length(body_digest), 0)"
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(f"SELECT id, {blobs}, {bodies} FROM calls"))).all()
    finally:
        await engine.dispose()
    found = {r[0]: (int(r[1]), int(r[2])) for r in rows}
    return [found[i][0] for i in ids], [found[i][1] for i in ids]


def _sent_bytes(rec: CallRecord) -> int:
    """Bytes of the call's bodies as JSON text: what a store keeping them whole holds."""
    return len(json.dumps(rec.request_body).encode()) + len(json.dumps(rec.response_body).encode())


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
    sizes, body_sizes, writes = [], [], []
    for _ in range(args.repeats):
        attempt_id, records, seconds = await _conversation(store, args, reused=reused)
        ids, bodies = await _stored_bytes(url, [r.id for r in records])
        sizes.append(ids)
        body_sizes.append(bodies)
        writes.append(seconds)
    listed = await store.list_calls(attempt_id, bodies=True)
    assert [c.prompt_ids for c in listed] == [r.prompt_ids for r in records], "a prompt read back differs"
    assert [c.request for c in listed] == [r.request_body for r in records], "a body read back differs"
    last = records[-1]
    return {
        "prompt": [len(r.prompt_ids) for r in records],
        "bytes": [statistics.median(s[t] for s in sizes) for t in range(args.turns)],
        "sent": [_sent_bytes(r) for r in records],
        "body": [statistics.median(s[t] for s in body_sizes) for t in range(args.turns)],
        "write": [statistics.median(w[t] for w in writes) for t in range(args.turns)],
        "list": [await _timed(lambda: store.list_calls(attempt_id, bodies=False))],
        "bodies": [await _timed(lambda: store.list_calls(attempt_id, bodies=True))],
        "last": [await _timed(lambda: store.call_bodies(attempt_id, last.request_id))],
        "parent": [await _timed(lambda: store.find_call_by_reply(attempt_id, [last.reply_digest]))],
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
    widths = (5, 10, 11, 11, 6, 10, 11, 14, 14, 6)
    out = [c.rjust(w) for c, w in zip(cells, widths, strict=True)]
    return " | ".join(" ".join(out[a:b]) for a, b in ((0, 2), (2, 5), (5, 7), (7, 10)))


def _print(whole: dict[str, list[float]], cont: dict[str, list[float]], args: argparse.Namespace) -> None:
    backend = "PostgreSQL" if args.store else "SQLite"
    print(
        f"{backend} store; {args.turns} turns, first context {args.context} tokens, +{args.turn_tokens} "
        f"per turn after a {RESPONSE}-token response; median of {args.repeats} conversations per way\n"
    )
    head = ("turn", "prompt ids", "ids B whole", "ids B cont.", "ratio", "body sent", "body stored")
    print(_row(*head, "write ms whole", "write ms cont.", "ratio"))
    for turn in sorted({1, 10, 25, args.turns} & set(range(1, args.turns + 1))):
        t = turn - 1
        bw, bc = whole["bytes"][t], cont["bytes"][t]
        ww, wc = whole["write"][t] * 1e3, cont["write"][t] * 1e3
        cells = (f"{bw:,.0f}", f"{bc:,.0f}", f"{bw / bc:.1f}", f"{cont['sent'][t]:,.0f}")
        cells += (f"{cont['body'][t]:,.0f}", f"{ww:.2f}", f"{wc:.2f}", f"{ww / wc:.2f}")
        print(_row(str(turn), f"{whole['prompt'][t]:.0f}", *cells))
    bw, bc = sum(whole["bytes"]), sum(cont["bytes"])
    ww, wc = sum(whole["write"]) * 1e3, sum(cont["write"]) * 1e3
    sent, body = sum(cont["sent"]), sum(cont["body"])
    cells = (f"{bw:,.0f}", f"{bc:,.0f}", f"{bw / bc:.1f}", f"{sent:,.0f}", f"{body:,.0f}")
    print(_row("all", "", *cells, f"{ww:.1f}", f"{wc:.1f}", f"{ww / wc:.2f}"))
    lw, lc = whole["list"][0] * 1e3, cont["list"][0] * 1e3
    pw, pc = whole["parent"][0] * 1e3, cont["parent"][0] * 1e3
    print(
        f"\nread back (whole prompts): list_calls of the {args.turns} calls {lw:.1f} ms whole, {lc:.1f} ms "
        f"continuation ({lc / lw:.2f}x); the last call's parent lookup {pw:.2f} ms whole, {pc:.2f} ms "
        f"continuation ({pc / pw:.2f}x)"
    )
    print(
        f"read back (whole bodies): list_calls with bodies {cont['bodies'][0] * 1e3:.1f} ms; the last "
        f"call's bodies (call_bodies, the previous_response_id lookup) {cont['last'][0] * 1e3:.2f} ms"
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
