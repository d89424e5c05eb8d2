"""The gateway's added latency and throughput, against the same engine called directly, in one run.

A minimal fast engine (bench/fast_engine.py) answers at once, so the difference between the
direct path and each gateway path is the proxy's own cost: admission, parsing the protocol,
chat-template rendering and tokenisation, routing, the engine hop, detokenisation and tool-call
parsing, rendering the answer, and the durable record (SQLite WAL commit). The same conversations
go through each of the gateway's three protocols (OpenAI Chat Completions, OpenAI Responses,
Anthropic Messages), posted as the official SDKs put them on the wire. Each client worker runs
multi-turn conversations on its own attempt key, one key per worker and protocol, as harnesses do.

The `floor` path is the least a Python proxy on the gateway's own stack does (bench/floor_proxy.py:
uvicorn, FastAPI, orjson, one aiohttp hop to the engine's Chat Completions endpoint, nothing else),
so that the gateway's cost splits into what the stack costs anyway and what its own work adds.

For scale, the LiteLLM proxy (pinned, in its own environment .cache/litellm, which `make
bench-gateway` installs) runs the Chat Completions conversations in front of the same engine's
Chat Completions endpoint; its added cost is over that endpoint called directly (`direct-chat`),
as the gateway's is over `/v1/completions` called directly (`direct`). LiteLLM runs with its
defaults, offline (`LITELLM_LOCAL_MODEL_COST_MAP=True`, a master key, no database), one worker,
without access log as the gateway. Each proxy's CPU time per call (its process group's, from
/proc/PID/stat before and after each path's measured rounds) is steadier than latency on a
shared machine.

With `--workers 1,2,4` it measures instead the throughput of `inharness gateway --workers N` at
concurrency 64 (Chat Completions conversations), each N on a new database of one PostgreSQL 15 server
started here (tests/postgres_server.py's, so it needs the server's binaries), next to one process on
SQLite and the engine called directly.

Run: make bench-gateway   (or: .venv/bin/python bench/gateway.py [--requests N] [--requests-serial N]
     [--litellm PATH] | [--workers 1,2,4])
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from inharness.procs import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin-token"
LITELLM_KEY = "sk-bench-master"
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
TURNS = 4  # turns per conversation before a worker starts a new one


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def direct_worker(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n: int, out: list[float]
) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    for _ in range(n):
        t = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
        out.append(time.perf_counter() - t)
        assert r.status == 200, r.status


def _first_turn(w: int, i: int) -> str:
    return f"What is {w}+{i}?"


class ChatPath:
    """OpenAI Chat Completions: the messages grow by the reply and a new user message."""

    route = "/v1/chat/completions"

    @staticmethod
    def start(w: int, i: int) -> Any:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _first_turn(w, i)}]

    @staticmethod
    def body(history: Any) -> dict[str, Any]:
        return {"model": "any-name", "messages": history, "tools": TOOLS, "max_tokens": 16, "temperature": 0}

    @staticmethod
    def extend(history: Any, answer: dict[str, Any]) -> Any:
        return [*history, answer["choices"][0]["message"], {"role": "user", "content": "and then?"}]


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


class ResponsesPath:
    """OpenAI Responses, as Codex sends it: `instructions`, input items that grow by the output items."""

    route = "/v1/responses"

    @staticmethod
    def user(text: str) -> dict[str, Any]:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    @staticmethod
    def start(w: int, i: int) -> Any:
        return [ResponsesPath.user(_first_turn(w, i))]

    @staticmethod
    def body(history: Any) -> dict[str, Any]:
        return {
            "model": "any-name",
            "instructions": SYSTEM,
            "input": history,
            "tools": RESPONSES_TOOLS,
            "max_output_tokens": 16,
            "temperature": 0,
            "store": False,
        }

    @staticmethod
    def extend(history: Any, answer: dict[str, Any]) -> Any:
        return [*history, *answer["output"], ResponsesPath.user("and then?")]


MESSAGES_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


class MessagesPath:
    """Anthropic Messages, as Claude Code sends it: `system`, messages of content blocks."""

    route = "/v1/messages"

    @staticmethod
    def start(w: int, i: int) -> Any:
        return [{"role": "user", "content": _first_turn(w, i)}]

    @staticmethod
    def body(history: Any) -> dict[str, Any]:
        return {
            "model": "any-name",
            "system": SYSTEM,
            "messages": history,
            "tools": MESSAGES_TOOLS,
            "max_tokens": 16,
            "temperature": 0,
        }

    @staticmethod
    def extend(history: Any, answer: dict[str, Any]) -> Any:
        return [
            *history,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "and then?"},
        ]


class EngineChatPath(ChatPath):
    """Chat Completions to a proxy that routes by model name (LiteLLM) or to the engine itself."""

    @staticmethod
    def body(history: Any) -> dict[str, Any]:
        return {**ChatPath.body(history), "model": "bench"}


PATHS: dict[str, Any] = {"chat": ChatPath, "responses": ResponsesPath, "messages": MessagesPath}
OTHER_PATHS: dict[str, Any] = {
    "direct-chat": EngineChatPath,
    "floor": EngineChatPath,
    "litellm": EngineChatPath,
}
# Each proxied path's added cost is over the engine endpoint it calls, called directly.
BASELINE = {
    "chat": "direct",
    "responses": "direct",
    "messages": "direct",
    "floor": "direct-chat",
    "litellm": "direct-chat",
}


def group_cpu_seconds(leader: int) -> float:
    """User + system CPU time so far of every process in the session `leader` started (a server and
    any workers it forks), from /proc."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[3]) == leader:  # field 6 of stat: the session id
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def floor_argv(port: int, engine_url: str) -> list[str]:
    script = str(Path(__file__).with_name("floor_proxy.py"))
    return [sys.executable, script, "--port", str(port), "--engine", engine_url]


def litellm_server(cli: Path, engine_url: str, work: Path) -> ServerProcess:
    """LiteLLM's proxy with one model, `bench`, routed to the engine's Chat Completions endpoint."""
    config = work / "litellm.json"  # JSON is YAML
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": "bench",
                        "litellm_params": {
                            "model": "openai/bench",
                            "api_base": f"{engine_url}/v1",
                            "api_key": "none",
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_KEY},
            }
        )
    )
    quiet = work / "litellm-log.json"  # uvicorn's logging, less the access log (the gateway has none)
    quiet.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "handlers": {"err": {"class": "logging.StreamHandler"}},
                "loggers": {
                    "uvicorn": {"handlers": ["err"], "level": "INFO"},
                    "uvicorn.access": {"handlers": ["err"], "level": "WARNING", "propagate": False},
                },
            }
        )
    )
    port = free_port()
    argv = [str(cli), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess(
        [*argv, "--num_workers", "1", "--log_config", str(quiet)],
        port=port,
        log=work / "litellm.log",
        health="/health/liveliness",
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        name="litellm",
    )


async def gateway_worker(
    session: aiohttp.ClientSession, url: str, path: Any, token: str, n: int, w: int, out: list[float]
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    history: Any = None
    for i in range(n):
        if i % TURNS == 0:
            history = path.start(w, i)
        t = time.perf_counter()
        async with session.post(f"{url}{path.route}", json=path.body(history), headers=headers) as r:
            data = await r.json()
        out.append(time.perf_counter() - t)
        assert r.status == 200, data
        history = path.extend(history, data)


async def measure(mode: str, concurrency: int, total: int, ctx: dict[str, Any]) -> tuple[list[float], float]:
    """Latencies of `total` requests from `concurrency` workers, and the wall time they took. The
    load client is aiohttp: with httpx the client itself was the bottleneck at concurrency 64."""
    per = max(1, total // concurrency)
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        if mode == "direct":
            jobs = [
                direct_worker(session, ctx["engine"], ctx["prompt"], per, lat) for _ in range(concurrency)
            ]
        elif mode in OTHER_PATHS:
            url, key = ctx["engine"] if mode == "direct-chat" else ctx[mode], LITELLM_KEY
            jobs = [
                gateway_worker(session, url, OTHER_PATHS[mode], key, per, w, lat) for w in range(concurrency)
            ]
        else:
            jobs = [
                gateway_worker(session, ctx["gateway"], PATHS[mode], ctx["tokens"][mode][w], per, w, lat)
                for w in range(concurrency)
            ]
        t = time.perf_counter()
        await asyncio.gather(*jobs)
        return lat, time.perf_counter() - t


async def breakdown(
    model_dir: Path, prompt_text_conv: list[dict[str, Any]], db: Path
) -> list[tuple[str, float]]:
    """Where a gateway request's time goes: the gateway's own steps, timed in this process."""
    from transformers import AutoTokenizer

    from inharness.gateway.conversation import Conversation, Message
    from inharness.gateway.prompts import fast_encoder
    from inharness.gateway.store import CallRecord, Store
    from inharness.gateway.toolcalls import parse_all

    tok = AutoTokenizer.from_pretrained(model_dir)
    fast = fast_encoder(tok)
    encode = (lambda t: fast.encode(t, add_special_tokens=False).ids) if fast else tok.encode
    conv = Conversation(tuple(Message(m["role"], m["content"]) for m in prompt_text_conv), tuple(TOOLS))
    msgs = conv.template_messages()

    def timeit(fn: Any, n: int = 300) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    reply = tok.encode("The answer is 5.", add_special_tokens=False)
    prompt_text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    rows = [
        ("digest chain", timeit(conv.digest_chain)),
        (
            "render chat template",
            timeit(
                lambda: tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
            ),
        ),
        (
            "tokenize prompt",
            timeit(lambda: encode(prompt_text)),
        ),
        ("detokenize + parse reply", timeit(lambda: parse_all(tok.decode(reply, skip_special_tokens=True)))),
    ]
    store = await Store.open(f"sqlite:///{db}")
    try:
        from inharness.gateway import schema

        await store.create_rollouts(schema.CreateRollouts(tasks=[1]), default_max_attempts=1)
        att = await store.claim("default", 600)
        assert att is not None
        ids = tok.encode(tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False), add_special_tokens=False)

        def rec() -> CallRecord:
            now = time.time()
            return CallRecord(
                att.id,
                att.rollout_id,
                "r",
                0,
                "openai.chat",
                "m",
                0,
                "e",
                ids,
                reply,
                [-0.5] * len(reply),
                "stop",
                None,
                False,
                None,
                "q",
                "a",
                now,
                None,
                now,
                {},
                {},
            )

        n = 200
        t = time.perf_counter()
        for _ in range(n):
            await store.record_calls([rec()])
        rows.append(("durable record (1 at a time)", (time.perf_counter() - t) / n))
        t = time.perf_counter()
        await asyncio.gather(*(store.record_calls([rec()]) for _ in range(n)))
        rows.append(
            (f"durable record ({n} concurrent, group commit), per call", (time.perf_counter() - t) / n)
        )
        t = time.perf_counter()
        for _ in range(n):
            await store.attempt_by_token(att.token)
        rows.append(
            ("key lookup in the store (once per attempt, then cached)", (time.perf_counter() - t) / n)
        )
    finally:
        await store.close()
    return rows


def bench_workers(
    counts: list[int], requests: int, work: Path, model: Path, engine: ServerProcess, prompt: list[int]
) -> None:
    """Chat Completions throughput at concurrency 64 of one SQLite gateway process and of `--workers N`
    on PostgreSQL, alternated over two rounds, with the gateway's CPU per call (all its processes)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres_server import PostgresServer, postgres_bin_dir

    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise SystemExit("--workers needs PostgreSQL 15's server (make bench-gateway installs it)")
    pg = PostgresServer.start(bin_dir)
    setups = [("sqlite", 1, f"sqlite:///{work / 'gw-workers.db'}")]
    setups += [("postgresql", n, pg.create_database()) for n in counts]
    gateways: list[ServerProcess] = []
    try:
        ctxs = []
        for store, n, url in setups:
            port = free_port()
            argv = ["gateway", "--model", str(model), "--engine", engine.url, "--store", url]
            argv += ["--port", str(port), "--admin-token", ADMIN, "--workers", str(n)]
            gw = ServerProcess.inharness(
                argv, port=port, log=work / f"gateway-{store}-{n}.log", health="/healthz"
            )
            gateways.append(gw.start())
            with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
                c.post("/api/v1/rollouts", json={"tasks": list(range(64))}).raise_for_status()
                claim = {"lease_seconds": 3600}
                tokens = [
                    c.post("/api/v1/attempts/claim", json=claim).json()["attempt"]["token"] for _ in range(64)
                ]
            ctxs.append(
                {"engine": engine.url, "gateway": gw.url, "prompt": prompt, "tokens": {"chat": tokens}}
            )
        runs = [("direct", ctxs[0], None)] + [
            ("chat", ctx, gw) for ctx, gw in zip(ctxs, gateways, strict=True)
        ]
        for mode, ctx, _gw in runs:  # warm-up, discarded
            asyncio.run(measure(mode, 64, requests // 10, ctx))
        lat: dict[int, list[float]] = {}
        wall: dict[int, float] = {}
        cpu: dict[int, float] = {}
        for _round in range(2):
            for i, (mode, ctx, gw) in enumerate(runs):
                before = group_cpu_seconds(gw.proc.pid) if gw and gw.proc else 0.0
                got, sec = asyncio.run(measure(mode, 64, requests // 2, ctx))
                if gw and gw.proc:
                    cpu[i] = cpu.get(i, 0.0) + group_cpu_seconds(gw.proc.pid) - before
                lat.setdefault(i, []).extend(got)
                wall[i] = wall.get(i, 0.0) + sec
    finally:
        for gw in gateways:
            gw.stop()
        pg.stop()
    cpus = Path("/proc/cpuinfo").read_text().count("processor")
    print(
        "\ngateway processes (--workers) at concurrency 64, Chat Completions, minimal fast engine, "
        f"{cpus} CPUs"
    )
    print(
        f"{'store':>10} {'workers':>7} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}"
        f" {'gateway CPU ms':>15}"
    )
    names = [("engine", "-")] + [(store, str(n)) for store, n, _url in setups]
    for i, (store, n) in enumerate(names):
        xs = lat[i]
        row = f"{store:>10} {n:>7} {len(xs):>8} {pct(xs, 0.5) * 1e3:>8.2f} {pct(xs, 0.99) * 1e3:>8.2f}"
        row += f" {len(xs) / wall[i]:>8.0f}"
        print(row + (f" {cpu[i] / len(xs) * 1e3:>15.2f}" if i in cpu else f" {'':>15}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1280, help="requests per path at concurrency 64")
    ap.add_argument("--requests-serial", type=int, default=400, help="requests per path at concurrency 1")
    ap.add_argument(
        "--litellm",
        type=Path,
        default=ROOT / ".cache" / "litellm" / "bin" / "litellm",
        help="LiteLLM's CLI (litellm[proxy]); `make bench-gateway` installs it here",
    )
    ap.add_argument(
        "--workers",
        type=lambda v: [int(n) for n in v.split(",")],
        help="comma-separated worker counts: measure `--workers N` on PostgreSQL instead (no LiteLLM)",
    )
    args = ap.parse_args()
    if not args.workers and not args.litellm.exists():
        ap.error(f"no LiteLLM at {args.litellm}: `make bench-gateway` installs it, or pass --litellm PATH")

    from transformers import AutoTokenizer

    from inharness.engine.tiny import init_tiny

    work = Path(tempfile.mkdtemp(prefix="inharness-bench-"))
    model = init_tiny(work / "model")
    tok = AutoTokenizer.from_pretrained(model)
    reply = [*tok.encode("The answer is 5.", add_special_tokens=False), tok.eos_token_id]
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 1+2?"}]
    prompt = tok.encode(
        tok.apply_chat_template(first_turn, tools=TOOLS, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )

    eport, gport = free_port(), free_port()
    engine = ServerProcess(
        [
            sys.executable,
            str(Path(__file__).with_name("fast_engine.py")),
            "--port",
            str(eport),
            "--reply-ids",
            ",".join(map(str, reply)),
        ],
        port=eport,
        log=work / "engine.log",
        health="/health",
        name="fast-engine",
    )
    gateway = ServerProcess.inharness(
        [
            "gateway",
            "--model",
            str(model),
            "--engine",
            engine.url,
            "--store",
            f"sqlite:///{work / 'gw.db'}",
            "--port",
            str(gport),
            "--admin-token",
            ADMIN,
        ],
        port=gport,
        log=work / "gateway.log",
        health="/healthz",
    )
    if args.workers:
        engine.start()
        try:
            bench_workers(args.workers, args.requests, work, model, engine, prompt)
        finally:
            engine.stop()
        return 0
    litellm = litellm_server(args.litellm, engine.url, work)
    fport = free_port()
    floor = ServerProcess(
        floor_argv(fport, engine.url),
        port=fport,
        log=work / "floor.log",
        health="/health",
        name="floor-proxy",
    )
    engine.start()
    gateway.start()
    litellm.start()
    floor.start()
    try:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            c.post("/api/v1/rollouts", json={"tasks": list(range(64 * len(PATHS)))}).raise_for_status()
            tokens = {
                mode: [
                    c.post("/api/v1/attempts/claim", json={"lease_seconds": 3600}).json()["attempt"]["token"]
                    for _ in range(64)
                ]
                for mode in PATHS
            }
        ctx: dict[str, Any] = {
            "engine": engine.url,
            "gateway": gateway.url,
            "prompt": prompt,
            "tokens": tokens,
            "litellm": litellm.url,
            "floor": floor.url,
        }

        modes = ("direct", *PATHS, *OTHER_PATHS)
        assert engine.proc is not None and gateway.proc is not None and litellm.proc is not None
        assert floor.proc is not None
        proxy_pid = {"chat": gateway.proc.pid, "responses": gateway.proc.pid, "messages": gateway.proc.pid}
        proxy_pid["litellm"] = litellm.proc.pid
        proxy_pid["floor"] = floor.proc.pid
        lat: dict[tuple[str, int], list[float]] = {}
        wall: dict[tuple[str, int], float] = {}
        cpu: dict[tuple[str, int, str], float] = {}  # (mode, concurrency, "proxy" | "engine"): seconds
        for conc, total in ((1, args.requests_serial), (64, args.requests)):
            for mode in modes:  # warm-up, discarded
                asyncio.run(measure(mode, conc, max(conc * 2, total // 10), ctx))
            for _round in range(2):  # alternate, so drifts in machine load hit every path alike
                for mode in modes:
                    pids = {"engine": engine.proc.pid}
                    if mode in proxy_pid:
                        pids["proxy"] = proxy_pid[mode]
                    before = {k: group_cpu_seconds(pid) for k, pid in pids.items()}
                    got, sec = asyncio.run(measure(mode, conc, total // 2, ctx))
                    for k, pid in pids.items():
                        cpu[(mode, conc, k)] = (
                            cpu.get((mode, conc, k), 0.0) + group_cpu_seconds(pid) - before[k]
                        )
                    lat.setdefault((mode, conc), []).extend(got)
                    wall[(mode, conc)] = wall.get((mode, conc), 0.0) + sec

        cpus = Path("/proc/cpuinfo").read_text().count("processor")
        print(
            "\nthe gateway's three protocols and LiteLLM's proxy vs the same engine called directly "
            f"(minimal fast engine), {cpus} CPUs; added = over the `over` path; CPU ms per call of the "
            "proxy's and the engine's processes"
        )
        print(
            f"{'concurrency':>11} {'path':>11} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}"
            f" {'over':>11} {'added p50 ms':>13} {'added p99 ms':>13} {'throughput ratio':>17}"
            f" {'proxy CPU ms':>13} {'engine CPU ms':>14}"
        )
        for conc in (1, 64):
            for mode in modes:
                xs = lat[(mode, conc)]
                p50, p99, rps = pct(xs, 0.5), pct(xs, 0.99), len(xs) / wall[(mode, conc)]
                row = f"{conc:>11} {mode:>11} {len(xs):>8} {p50 * 1e3:>8.2f} {p99 * 1e3:>8.2f} {rps:>8.0f}"
                base = BASELINE.get(mode)
                if base is None:
                    row += f" {'':>11} {'':>13} {'':>13} {'':>17} {'':>13}"
                else:
                    b = lat[(base, conc)]
                    brps = len(b) / wall[(base, conc)]
                    row += (
                        f" {base:>11} {(p50 - pct(b, 0.5)) * 1e3:>13.2f} {(p99 - pct(b, 0.99)) * 1e3:>13.2f}"
                    )
                    row += f" {rps / brps:>17.2f} {cpu[(mode, conc, 'proxy')] / len(xs) * 1e3:>13.2f}"
                print(row + f" {cpu[(mode, conc, 'engine')] / len(xs) * 1e3:>14.2f}")

        steps = asyncio.run(breakdown(model, first_turn, work / "breakdown.db"))
        print("\nwhere a gateway call's own time goes (in-process, per call):")
        for name, sec in steps:
            print(f"  {name:<58} {sec * 1e6:>8.0f} us")
    finally:
        floor.stop()
        litellm.stop()
        gateway.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
