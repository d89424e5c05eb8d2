"""The CPU engine on rollouts shaped like the calc example: prefix cache + batching vs one request at a time.

Each "rollout" is two requests, as a two-turn conversation: a 218-token shared prefix (system prompt and tool
schema) plus ~15 tokens of its own, generating 20; then that prompt and response plus ~10 more tokens,
generating 7. Four clients run the rollouts concurrently against an `inharness` engine subprocess on a tiny
random-init model (`--threads 1`, as `inharness run` starts it; `ignore_eos` and a fixed `max_tokens` fix the
lengths). The same engine code runs with its defaults, with `--prefix-cache-tokens 0 --max-batch 1` (the
one-request-at-a-time engine this replaced) and with each saving alone, alternately, measuring wall time and
the engine process's CPU time; every mode's sampled tokens and logprobs are compared with the old one's (they
must agree: both savings are exact).

Run: make bench-engine   (or: .venv/bin/python bench/engine_batching.py [--rollouts 32] [--repeats 2])
"""

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from inharness.engine.tiny import init_tiny
from inharness.procs import ServerProcess, free_port

PREFIX = 218
NO_CACHE, NO_BATCH = ["--prefix-cache-tokens", "0"], ["--max-batch", "1"]
MODES = {
    "old (no cache, batch 1)": [*NO_CACHE, *NO_BATCH],
    "prefix cache only": NO_BATCH,
    "batching only": NO_CACHE,
    "cache + batching": [],
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rollout(client: httpx.Client, url: str, prefix: list[int], index: int) -> list[dict[str, Any]]:
    """Two requests of one conversation; their choices (token ids and logprobs)."""
    rng = random.Random(index)
    vocab = 3000
    first = [*prefix, *(rng.randrange(vocab) for _ in range(rng.randint(13, 17)))]
    body = {"model": "tiny", "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "seed": index}
    one = client.post(f"{url}/v1/completions", json={**body, "prompt": first, "max_tokens": 20}).json()
    reply = one["choices"][0]["token_ids"]
    second = [*first, *reply, *(rng.randrange(vocab) for _ in range(rng.randint(8, 12)))]
    two = client.post(f"{url}/v1/completions", json={**body, "prompt": second, "max_tokens": 7}).json()
    return [one["choices"][0], two["choices"][0]]


def run(url: str, pid: int, rollouts: int, clients: int, prefix: list[int]) -> tuple[float, float, list[Any]]:
    """All rollouts from ``clients`` concurrent clients: (wall s, engine CPU s, choices by rollout)."""
    results: list[Any] = [None] * rollouts
    todo = iter(range(rollouts))
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    index = next(todo, None)
                if index is None:
                    return
                results[index] = rollout(client, url, prefix, index)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    cpu, start = cpu_seconds(pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, cpu_seconds(pid) - cpu, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    args = parser.parse_args()

    prefix = [random.Random(0).randrange(3000) for _ in range(PREFIX)]
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model = init_tiny(Path(tmp) / "tiny", seed=0)
        engines = {}
        for name, flags in MODES.items():
            port = free_port()
            argv = [sys.executable, "-m", "inharness.cli", "engine", "--model", str(model)]
            argv += ["--port", str(port)]
            engines[name] = ServerProcess(
                [*argv, "--threads", "1", *flags], port=port, log=Path(tmp) / f"{port}.log", health="/health"
            ).start()
        try:
            for engine in engines.values():  # warm up: first-call costs are not the engine's steady state
                assert engine.proc is not None
                run(engine.url, engine.proc.pid, 2, 1, prefix)
            measured: dict[str, list[tuple[float, float]]] = {name: [] for name in MODES}
            outputs: dict[str, list[Any]] = {}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    assert engine.proc is not None
                    wall, cpu, outputs[name] = run(
                        engine.url, engine.proc.pid, args.rollouts, args.clients, prefix
                    )
                    measured[name].append((wall, cpu))
        finally:
            for engine in engines.values():
                engine.stop()

    reference = next(iter(MODES))
    pairs = [
        (a, b)
        for name in MODES
        if name != reference
        for ra, rb in zip(outputs[reference], outputs[name], strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in pairs)
    drift = max(
        abs(x - y)
        for a, b in pairs
        if a["token_ids"] == b["token_ids"]
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True)
    )
    requests = 2 * args.rollouts
    print(
        f"{args.rollouts} rollouts x 2 requests ({PREFIX}-token shared prefix), {args.clients} clients, "
        f"engine --threads 1, {os.cpu_count()} CPUs, best of {args.repeats}"
    )
    header = f"{'mode':>24} {'wall s':>7} {'engine CPU s':>13} {'CPU ms/request':>15} {'rollouts/s':>11}"
    print(f"{header} {'old/this wall':>14} {'old/this CPU':>13}")
    best = {name: min(runs) for name, runs in measured.items()}
    old_wall, old_cpu = best[reference]
    for name, (wall, cpu) in best.items():
        print(
            f"{name:>24} {wall:7.2f} {cpu:13.2f} {1000 * cpu / requests:15.1f} {args.rollouts / wall:11.2f} "
            f"{old_wall / wall:13.2f}x {old_cpu / cpu:12.2f}x"
        )
    print(
        f"same tokens as the old mode: {same}/{len(pairs)} requests of the other modes; "
        f"max |logprob difference| {drift:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
