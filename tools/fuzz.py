"""Fuzz what users run: Schemathesis' own command line (`st run`) on the gateway's served
`/openapi.json`, in front of a real `inharness engine` with the tiny model and SQLite stores.

Why the command line and not only tests/gateway/test_schema_fuzz.py: that file replays the same
derandomized cases against an instant stand-in engine, so it catches regressions but finds nothing it
has not seen. An outside fuzzer with a fresh seed found the engine's 5xx on top_p 5e-324 and the export
that broke off mid-stream within minutes (issue 32). This runs the same tool the same way:

- harness routes (`/v1/...` and `/t/{token}/...`, the attempt's key in the header and the path) on
  one gateway: phases examples, coverage (the schema's boundary values) and fuzzing;
- control routes (`/api/v1/...`) on a gateway of their own, since they pause serving and end
  attempts: the same phases and the stateful one (sequences of calls linked by the ids they return).
  `POST /api/v1/models/versions` is left out: it contacts the engine URLs it is given.

Each `st run` checks `not_a_server_error` (a 5xx) and reports a response that broke off (a
truncated export) as a network error; every failure is printed with the curl command that
reproduces it, and the seed is printed first and last, so `--seed` replays a run. The gateways cap a
call at `--max-tokens 16`, which keeps a case near a few milliseconds on the tiny model; it is the
flag a TrainingRun's spec.generation.maxTokens sets.

`make fuzz SECONDS=N` runs every phase for N seconds in all; tests/gateway/test_fuzz_real_engine.py
runs a bounded part (coverage, and stateful on the control routes) in `make test`.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inharness.procs import ServerProcess, free_port

ALL_PHASES = ("examples", "coverage", "fuzzing", "stateful")
HARNESS_PATHS = r"^/(v1/|t/\{token\}/)"
CONTROL_PATHS = r"^/api/v1/"
# POST /api/v1/models/versions: it contacts the engine URLs it is given.
REGISTER_VERSION = "register_version_api_v1_models_versions_post"
ADMIN = "fuzz-admin-" + secrets.token_hex(8)


@dataclass
class Target:
    """One `st run`: which routes, with which key, which phases, for what share of the time."""

    name: str
    gateway: str
    paths: str
    token: str
    phases: tuple[str, ...]
    exclude: list[str] = field(default_factory=list)


@dataclass
class Stack:
    """The servers a run talks to, all on 127.0.0.1."""

    engine: ServerProcess
    harness: ServerProcess
    control: ServerProcess
    attempt_key: str

    def stop(self) -> None:
        for server in (self.control, self.harness, self.engine):
            server.stop()


def _gateway(model: Path, engines: list[str], db: Path, log: Path, extra: list[str]) -> ServerProcess:
    port = free_port()
    args = ["gateway", "--model", str(model), "--store", f"sqlite:///{db}", "--port", str(port)]
    args += [f"--admin-token={ADMIN}", "--max-tokens", "16", *extra]
    for e in engines:
        args += ["--engine", e]
    return ServerProcess.inharness(args, port=port, log=log, health="/healthz").start()


def start_stack(work: Path) -> Stack:
    """A tiny model, a real engine serving it, a harness gateway with one claimed attempt, and a
    control gateway (no engine; a fuzzed pause ends by itself after a second)."""
    from inharness.engine.tiny import init_tiny

    model = init_tiny(work / "tiny", seed=0)
    port = free_port()
    engine = ServerProcess.inharness(
        ["engine", "--model", str(model), "--port", str(port), "--threads", "1"],
        port=port,
        log=work / "engine.log",
        health="/health",
    ).start()
    harness = _gateway(model, [engine.url], work / "harness.db", work / "harness-gateway.log", [])
    control = _gateway(model, [], work / "control.db", work / "control-gateway.log", ["--hold-seconds", "1"])
    with httpx.Client(base_url=harness.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
        c.post("/api/v1/rollouts", json={"tasks": [{"question": "fuzz"}]}).raise_for_status()
        r = c.post("/api/v1/attempts/claim", json={"lease_seconds": 86_400})
        r.raise_for_status()
    return Stack(engine, harness, control, r.json()["attempt"]["token"])


def targets(stack: Stack, phases: tuple[str, ...]) -> list[Target]:
    harness_phases = tuple(p for p in phases if p != "stateful")  # each call stands alone
    out = []
    if harness_phases:
        out.append(Target("harness", stack.harness.url, HARNESS_PATHS, stack.attempt_key, harness_phases))
    out.append(Target("control", stack.control.url, CONTROL_PATHS, ADMIN, phases, exclude=[REGISTER_VERSION]))
    return out


def st_command(
    target: Target, *, seed: int, seconds: int, max_examples: int | None, config: Path
) -> list[str]:
    st = Path(sys.executable).with_name("st")
    cmd = [str(st), "--config-file", str(config), "run", f"{target.gateway}/openapi.json"]
    cmd += ["--url", target.gateway, "--include-path-regex", target.paths]
    for operation_id in target.exclude:
        cmd += ["--exclude-operation-id", operation_id]
    cmd += ["--phases", ",".join(target.phases), "--checks", "not_a_server_error"]
    cmd += ["-H", f"Authorization: Bearer {target.token}", "--seed", str(seed), "--max-time", str(seconds)]
    cmd += ["--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all", "--no-color"]
    cmd += ["--generation-database", "none"]
    if max_examples is not None:
        cmd += ["--max-examples", str(max_examples)]
    return cmd


def write_config(path: Path, token: str) -> Path:
    """Schemathesis' configuration: the `/t/{token}` routes get the attempt's key, not random strings
    (which only ever reach the 401 that the header-keyed routes already cover)."""
    path.write_text(f'[parameters]\n"path.token" = "{token}"\n')
    return path


def run(
    *,
    seconds: int,
    seed: int,
    phases: tuple[str, ...] = ALL_PHASES,
    max_examples: int | None = None,
    work: Path,
    out: object = None,
) -> int:
    """Start the stack, run `st` on each target (the time split evenly), print everything; 0 when no
    target failed."""
    stream = out or sys.stdout
    print(f"fuzz seed {seed}: phases {','.join(phases)}, {seconds} s in all", file=stream, flush=True)
    stack = start_stack(work)
    failed: list[str] = []
    try:
        config = write_config(work / "schemathesis.toml", stack.attempt_key)
        plan = targets(stack, phases)
        deadline = time.monotonic() + seconds
        for i, target in enumerate(plan):
            share = max(1, int((deadline - time.monotonic()) / (len(plan) - i)))
            cmd = st_command(target, seed=seed, seconds=share, max_examples=max_examples, config=config)
            print(f"\n=== {target.name} routes ({share} s): {' '.join(cmd)}", file=stream, flush=True)
            env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
            result = subprocess.run(  # in `work`: st keeps a cache folder where it runs
                cmd, stdout=stream, stderr=subprocess.STDOUT, env=env, check=False, cwd=work
            )
            if result.returncode != 0:
                failed.append(f"{target.name} (st exit {result.returncode})")
    finally:
        stack.stop()
    verdict = "no failures" if not failed else "FAILED: " + ", ".join(failed)
    print(f"\nfuzz seed {seed}: {verdict} (replay: make fuzz SEED={seed})", file=stream, flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=600, help="time for all phases together")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh one)")
    parser.add_argument("--phases", default=",".join(ALL_PHASES))
    parser.add_argument("--max-examples", type=int, default=None, help="cases per route and phase")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    phases = tuple(p for p in args.phases.split(",") if p)
    with tempfile.TemporaryDirectory(prefix="inharness-fuzz-") as work:
        return run(
            seconds=args.seconds, seed=seed, phases=phases, max_examples=args.max_examples, work=Path(work)
        )


if __name__ == "__main__":
    sys.exit(main())
