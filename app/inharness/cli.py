"""`inharness`: the one console script. Each subcommand is a thin shell over a component's API.

The subcommands are a table (`COMMANDS`): each row names its flags and the function it runs, so
`main` only builds the parser from the table and calls the chosen row. Component imports happen
inside the handlers, so `inharness gateway` does not load torch and `--help` stays fast.
"""

import argparse
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args, get_origin

from inharness.engine import DEFAULT_PORT as ENGINE_PORT
from inharness.engine import TINY_CONTEXT
from inharness.run import DEFAULT_MAX_CONSECUTIVE_FAILURES

GATEWAY_ENV_PREFIX = "INHARNESS_GATEWAY_"


@dataclass(frozen=True)
class Command:
    """One subcommand: its flags (`arguments` adds them to its parser) and what it runs."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None


@dataclass(frozen=True)
class Group:
    """A subcommand that only holds subcommands (`inharness operator run|render|crds`)."""

    name: str
    help: str
    commands: tuple[Command, ...]


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum`, refused with argparse's own message."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its 'invalid value' message
    return parse


# --- inharness model init-tiny ------------------------------------------------------------------


def _init_tiny_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--context",
        type=_at_least(16),
        default=TINY_CONTEXT,
        help=f"context in tokens (default {TINY_CONTEXT}; real harnesses' first prompts "
        "take 10-25k tokens of this tokenizer: 65536 fits them)",
    )


def _init_tiny(args: argparse.Namespace) -> int:
    from inharness.engine.tiny import init_tiny

    print(init_tiny(args.dir, seed=args.seed, context=args.context))
    return 0


# --- inharness engine ---------------------------------------------------------------------------


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    from inharness.engine import auth  # no torch: `--help` stays fast
    from inharness.engine.script import SCRIPT_ENV

    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=ENGINE_PORT)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--threads",
        type=_at_least(1),
        default=None,
        help="torch intra-op threads (default: torch's, one per core); 1 where harnesses share the cores",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=_at_least(0),
        default=None,
        help="prefix cache size in tokens (0: off; default: the model's context)",
    )
    p.add_argument(
        "--max-batch",
        type=_at_least(1),
        default=16,
        help="rows decoded together (default 16; 1: no batching)",
    )
    p.add_argument(
        "--script",
        default=None,
        help=f"answer with the scripted completions of this JSON file (default: ${SCRIPT_ENV}; "
        "docs/harnesses.md)",
    )
    auth.add_arguments(p)


def _engine(args: argparse.Namespace) -> int:
    from inharness.engine.auth import AuthError
    from inharness.engine.server import serve

    try:
        serve(
            args.model,
            args.host,
            args.port,
            served_model_name=args.served_model_name,
            threads=args.threads,
            prefix_cache_tokens=args.prefix_cache_tokens,
            max_batch=args.max_batch,
            script=args.script,
            api_key_file=args.api_key_file,
            weights_root=args.weights_root,
        )
    except AuthError as exc:
        print(f"inharness engine: {exc}", file=sys.stderr)
        return 2
    return 0


# --- inharness gateway --------------------------------------------------------------------------


def _gateway_flag(name: str) -> str:
    return "--engine" if name == "engines" else "--" + name.replace("_", "-")


def _gateway_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per `GatewaySettings` field, generated, so that a new setting cannot lack one."""
    from inharness.gateway.settings import GatewaySettings

    for name, field in GatewaySettings.model_fields.items():
        shown = "" if field.is_required() else f" (default: {field.get_default(call_default_factory=True)})"
        options: dict[str, object] = {
            "dest": name,
            "default": None,
            "help": (field.description or "") + shown,
        }
        if name == "engines":
            options |= {
                "action": "append",
                "metavar": "URL",
                "help": "engine base URL (repeatable): vLLM's server or `inharness engine`",
            }
        elif get_origin(field.annotation) is Literal:
            options["choices"] = get_args(field.annotation)
        else:
            options["type"] = _scalar(field.annotation)
        p.add_argument(_gateway_flag(name), **options)  # type: ignore[arg-type]


def _scalar(annotation: object) -> type:
    """The flag's type for a setting typed `int`, `float`, `str` or `X | None`."""
    kinds = [a for a in (get_args(annotation) or (annotation,)) if a is not type(None)]
    return kinds[0] if len(kinds) == 1 and kinds[0] in (int, float, str) else str


def gateway_values(args: argparse.Namespace) -> dict[str, object]:
    """The settings given as flags, else as env vars; the rest keep the model's defaults."""
    from inharness.gateway.settings import GatewaySettings

    values: dict[str, object] = {}
    for name in GatewaySettings.model_fields:
        value = getattr(args, name)
        env = os.environ.get(GATEWAY_ENV_PREFIX + name.upper())
        if value is None and env:
            value = [e for e in env.split(",") if e] if name == "engines" else env
        if value is not None:
            values[name] = value
    return values


def _gateway(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from inharness.gateway.app import serve
    from inharness.gateway.settings import GatewaySettings

    values = gateway_values(args)
    if "model" not in values:
        print(f"inharness gateway: --model (or {GATEWAY_ENV_PREFIX}MODEL) is required", file=sys.stderr)
        return 2
    if "admin_token" not in values and "admin_token_file" not in values:
        values["admin_token"] = secrets.token_hex(24)
        print(f"no --admin-token given; generated one for this run: {values['admin_token']}", file=sys.stderr)
    try:
        settings = GatewaySettings.model_validate(values)
    except ValidationError as exc:
        errors = "; ".join(
            f"{_gateway_flag(str(e['loc'][0]))} ({GATEWAY_ENV_PREFIX}{str(e['loc'][0]).upper()}): {e['msg']}"
            if e["loc"]
            else e["msg"]
            for e in exc.errors()
        )
        print(f"inharness gateway: {errors}", file=sys.stderr)
        return 2
    return serve(settings)


# --- inharness operator run | render | crds -----------------------------------------------------


def _operator_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics")
    p.add_argument("--liveness-port", type=int, default=8081, help="liveness probe /healthz")
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=float(_env("INHARNESS_OPERATOR_RESYNC_SECONDS", "30") or 30),
        help="every run is re-converged this often, whether or not an event arrived",
    )
    p.add_argument(
        "--gateway-url",
        default=_env("INHARNESS_OPERATOR_GATEWAY_URL"),
        help="where a run's gateway answers, {name} and {namespace} filled in (progress for the status; "
        "default: the run's gateway Service)",
    )


def _operator_run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from inharness.operator.main import OperatorConfig, run

    try:
        config = OperatorConfig(
            namespaces=args.namespace,
            all_namespaces=args.all_namespaces,
            metrics_port=args.metrics_port,
            liveness_port=args.liveness_port,
            resync_seconds=args.resync_seconds,
            **({"gateway_url": args.gateway_url} if args.gateway_url else {}),
        )
    except ValidationError as exc:
        print(f"inharness operator run: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    return run(config)


def _operator_render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="YAML with the TrainingRun, its RolloutPool and HarnessSpec")
    p.add_argument("--namespace", default=None, help="namespace of a run that names none (default: default)")
    p.add_argument("--run", default=None, help="the TrainingRun to render when the file holds several")
    p.add_argument(
        "--admin-token",
        default=None,
        help="the gateway admin token to put in the Secret (default: a new one)",
    )


def _operator_render(args: argparse.Namespace) -> int:
    from inharness.operator.render import RenderSettings, render_file
    from inharness.operator.specfile import SpecError

    extra = {"namespace": args.namespace} if args.namespace else {}
    try:
        out = render_file(
            args.file, settings=RenderSettings.from_env(**extra), admin_token=args.admin_token, run=args.run
        )
    except SpecError as exc:
        print(f"inharness operator render: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(out)
    return 0


def _operator_crds_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        action="append",
        default=None,
        help="directory to write to (repeatable; default: crds and charts/inharness/crds)",
    )
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming the files that are stale"
    )


def _operator_crds(args: argparse.Namespace) -> int:
    from inharness.operator import crds

    dirs = [Path(d) for d in (args.out or crds.OUT_DIRS)]
    if args.check:
        stale = [str(path) for d in dirs for path in crds.stale(d)]
        if stale:
            print(f"inharness operator crds: stale: {', '.join(stale)}; run `make crds`", file=sys.stderr)
            return 1
        return 0
    for d in dirs:
        for path in crds.write(d):
            print(path)
    return 0


# --- inharness run ------------------------------------------------------------------------------


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="YAML with the TrainingRun, its RolloutPool and HarnessSpec")
    p.add_argument("--out", default=None, help="output directory (default: ./runs/<TrainingRun name>)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument(
        "--max-consecutive-failures",
        type=_at_least(0),
        default=DEFAULT_MAX_CONSECUTIVE_FAILURES,
        metavar="N",
        help="stop once N attempts in a row failed the same way before any model call "
        f"(default {DEFAULT_MAX_CONSECUTIVE_FAILURES}; 0: never)",
    )


def _run(args: argparse.Namespace) -> int:
    from inharness.run import run_file

    return run_file(
        Path(args.file),
        Path(args.out) if args.out else None,
        resume=args.resume,
        max_consecutive_failures=args.max_consecutive_failures,
    )


# --- inharness sft ------------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


_positive_float.__name__ = "number"


def _sft_arguments(p: argparse.ArgumentParser) -> None:
    from inharness.trainer.warmup import WarmupConfig  # dataclasses only: --help stays fast

    d = WarmupConfig()
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="RUN_DIR_OR_STORE",
        help="where the recorded attempts are: a run directory (its gateway.db), a SQLite file, or a store "
        "URL (sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB)",
    )
    p.add_argument("--model", required=True, help="the model directory to start from")
    p.add_argument("--out", required=True, help="where the warmed-up model directory is written")
    p.add_argument(
        "--min-reward",
        type=float,
        default=None,
        help="keep only rollouts whose reward is at least this (rejection sampling; default: every "
        "succeeded rollout with a reward)",
    )
    p.add_argument("--steps", type=_at_least(1), default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--lr", type=_positive_float, default=d.learning_rate, help="peak learning rate")
    p.add_argument("--batch-size", type=_at_least(1), default=d.batch_size, help="samples per step")
    p.add_argument(
        "--max-tokens-per-microbatch",
        type=_at_least(1),
        default=d.max_tokens_per_microbatch,
        help="token budget of one forward pass (rows x longest row)",
    )
    p.add_argument(
        "--context-gradient",
        action="store_true",
        help="back-propagate through the prompt too (default: the prompt before the first learnt token "
        "runs without gradient, about 3x cheaper a step on a harness's long prompt)",
    )
    p.add_argument("--seed", type=int, default=d.seed)


def _sft(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from inharness.gateway.store import StoreError
    from inharness.trainer.warmup import NoWarmupData, WarmupConfig, sft_from

    config = WarmupConfig(
        steps=args.steps,
        learning_rate=args.lr,
        batch_size=args.batch_size,
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        seed=args.seed,
        context_gradient=args.context_gradient,
    )
    bar = tqdm(total=config.steps, desc="sft", dynamic_ncols=True)  # shown in logs too, as `run`'s bars

    def progress(step: int, metrics: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tokens=int(metrics["tokens"]))

    try:
        summary = sft_from(
            args.source,
            Path(args.model),
            Path(args.out),
            config,
            min_reward=args.min_reward,
            log=tqdm.write,
            progress=progress,
        )
    except (NoWarmupData, StoreError) as exc:
        bar.close()
        print(f"inharness sft: {exc}", file=sys.stderr)
        return 2
    bar.close()
    print(
        f"inharness sft: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} over {config.steps} "
        f"steps on {summary['samples']} samples of {summary['rollouts_kept']} rollouts in "
        f"{summary['seconds']:.0f} s; model in {args.out} (sft_summary.json, sft_loss.png)"
    )
    return 0


# --- inharness train ----------------------------------------------------------------------------


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the run's spec file (the ConfigMap's run.yaml)")
    p.add_argument("--out", required=True, help="work directory: checkpoints, weights, metrics")
    p.add_argument("--gateway-url", default=_env("INHARNESS_GATEWAY_URL"), help="the run's gateway")
    p.add_argument("--engine-host", default=_env("INHARNESS_ENGINE_HOST", "0.0.0.0"))
    p.add_argument("--engine-port", type=int, default=int(_env("INHARNESS_ENGINE_PORT") or ENGINE_PORT))
    p.add_argument(
        "--engine-url",
        default=_env("INHARNESS_ENGINE_URL"),
        help="this engine as the gateway reaches it (default: http://127.0.0.1:<engine port>)",
    )
    p.add_argument(
        "--admin-token-file",
        default=_env("INHARNESS_GATEWAY_ADMIN_TOKEN_FILE"),
        help="file holding the gateway's admin token (or INHARNESS_GATEWAY_ADMIN_TOKEN_FILE; "
        "else env INHARNESS_GATEWAY_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--engine-api-key-file",
        default=_env("INHARNESS_ENGINE_API_KEY_FILE"),
        help="file holding the engine's API key, which the gateway sends too (or "
        "INHARNESS_ENGINE_API_KEY_FILE; none: the engine takes no key)",
    )
    ray = p.add_argument_group(
        "Ray cluster (engine verl)",
        "every trainer pod runs the same command: pod 0 starts the Ray head and trains, the others join "
        "it and block (what the operator renders for spec.trainer.engine verl)",
    )
    ray.add_argument(
        "--ray-nodes", type=_at_least(1), help="nodes of the cluster, the head's included; unset: no Ray"
    )
    ray.add_argument("--ray-head-address", help="HOST:PORT where the other pods join the head")
    ray.add_argument("--ray-node-ip", default=_env("POD_IP"), help="this node's IP (default: env POD_IP)")
    ray.add_argument("--ray-gpus", type=_at_least(0), default=0, help="GPUs this node offers")
    ray.add_argument("--ray-cpus", type=_at_least(1), default=1, help="CPUs this node offers")
    ray.add_argument(
        "--ray-object-store-memory",
        type=_at_least(1),
        help="object store bytes (default: half of this machine's /dev/shm)",
    )
    ray.add_argument(
        "--pod-index",
        type=_at_least(0),
        help="this pod's ordinal, 0 for the head (default: env POD_INDEX, else the -N suffix of POD_NAME)",
    )
    ray.add_argument(
        "--ray-wait-seconds",
        type=float,
        help="how long the head waits for every node to join before it exits and restarts (default: 1800)",
    )


def _train(args: argparse.Namespace) -> int:
    from inharness.engine.auth import AuthError, read_key_file
    from inharness.train import RayCluster, ray_worker, train_file

    ray = None
    if args.ray_nodes is not None:
        try:
            ray = RayCluster.from_flags(
                nodes=args.ray_nodes,
                head_address=args.ray_head_address,
                node_ip=args.ray_node_ip,
                gpus=args.ray_gpus,
                cpus=args.ray_cpus,
                object_store_memory=args.ray_object_store_memory,
                pod_index=args.pod_index,
                pod_index_label=_env("POD_INDEX"),
                pod_name=_env("POD_NAME") or _env("HOSTNAME"),
                wait_seconds=args.ray_wait_seconds,
            )
        except ValueError as exc:
            print(f"inharness train: {exc}", file=sys.stderr)
            return 2
    if ray is not None and not ray.head:
        return ray_worker(ray, health_host=args.engine_host, health_port=args.engine_port)
    token = _env("INHARNESS_GATEWAY_ADMIN_TOKEN")
    if args.admin_token_file:
        try:
            token = read_key_file(args.admin_token_file)
        except AuthError as exc:
            where = "--admin-token-file (INHARNESS_GATEWAY_ADMIN_TOKEN_FILE)"
            print(f"inharness train: no admin token from {where}: {exc}", file=sys.stderr)
            return 2
    if not args.gateway_url or not token:
        print(
            "inharness train: needs --gateway-url (or INHARNESS_GATEWAY_URL) and the admin token "
            "(--admin-token-file, INHARNESS_GATEWAY_ADMIN_TOKEN_FILE or INHARNESS_GATEWAY_ADMIN_TOKEN)",
            file=sys.stderr,
        )
        return 2
    return train_file(
        Path(args.config),
        Path(args.out),
        gateway_url=args.gateway_url,
        admin_token=token,
        engine_url=args.engine_url or f"http://127.0.0.1:{args.engine_port}",
        engine_host=args.engine_host,
        engine_port=args.engine_port,
        engine_api_key_file=Path(args.engine_api_key_file) if args.engine_api_key_file else None,
        ray=ray,
    )


# --- inharness simulate -------------------------------------------------------------------------


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    from inharness.trainer.simulate.cli import add_arguments  # standard library only: --help stays fast

    add_arguments(p)


def _simulate(args: argparse.Namespace) -> int:
    from inharness.trainer.simulate.cli import run

    return run(args)


COMMANDS: tuple[Command | Group, ...] = (
    Group(
        "model",
        "model utilities",
        (
            Command(
                "init-tiny",
                "create a small random-init causal LM and tokenizer in DIR",
                _init_tiny_arguments,
                _init_tiny,
            ),
        ),
    ),
    Command(
        "engine",
        "run the built-in CPU inference engine (vLLM-compatible subset)",
        _engine_arguments,
        _engine,
    ),
    Command(
        "gateway",
        "run the recording gateway (OpenAI-compatible API for harnesses, control API for the trainer)",
        _gateway_arguments,
        _gateway,
        description=f"Every flag also reads an env var, {GATEWAY_ENV_PREFIX}<FIELD> (e.g. "
        f"{GATEWAY_ENV_PREFIX}ADMIN_TOKEN; engines: {GATEWAY_ENV_PREFIX}ENGINES, comma-separated); "
        "a flag wins over its env var.",
    ),
    Group(
        "operator",
        "the Kubernetes operator",
        (
            Command(
                "run",
                "reconcile TrainingRuns and RolloutPools (in-cluster service account, else KUBECONFIG)",
                _operator_run_arguments,
                _operator_run,
                description="Default images of the children: env INHARNESS_GATEWAY_IMAGE, "
                "INHARNESS_TRAINER_IMAGE.",
            ),
            Command(
                "render",
                "print the objects the operator creates for a spec file (YAML; for diff or kubectl apply)",
                _operator_render_arguments,
                _operator_render,
            ),
            Command(
                "crds",
                "write the CustomResourceDefinitions generated from the spec models (what `make crds` runs)",
                _operator_crds_arguments,
                _operator_crds,
            ),
        ),
    ),
    Command(
        "run",
        "train locally from a spec file (TrainingRun + RolloutPool + HarnessSpec)",
        _run_arguments,
        _run,
    ),
    Command(
        "sft",
        "supervised warm-up on recorded attempts (a teacher's or the policy's), read from a gateway store",
        _sft_arguments,
        _sft,
        description="Keeps the succeeded rollouts (with --min-reward, those rewarded at least that), merges "
        "each final attempt's calls as the RL loop does (loss on the model's tokens only) and writes a "
        "model directory that spec.model.path can name.",
    ),
    Command(
        "train",
        "the trainer of a TrainingRun on a cluster, against the run's gateway (what the operator runs)",
        _train_arguments,
        _train,
        description="Resumes from the last checkpoint in --out. The admin token comes from "
        "--admin-token-file (INHARNESS_GATEWAY_ADMIN_TOKEN_FILE) or env INHARNESS_GATEWAY_ADMIN_TOKEN.",
    ),
    Command(
        "simulate",
        "plan a run: its timeline under each scheduling mode (steps/hour, GPU busy, staleness)",
        _simulate_arguments,
        _simulate,
        description="A discrete-event simulation of one TrainingRun under sync, async and "
        "collocated-async, on a preset workload (swe, calc), a file of overrides or a recorded run "
        "(docs/simulate.md).",
    ),
)


def _add(sub: argparse._SubParsersAction, entry: Command | Group, depth: int) -> None:
    if isinstance(entry, Command):
        p = sub.add_parser(entry.name, help=entry.help, description=entry.description or entry.help)
        entry.arguments(p)
        p.set_defaults(handler=entry.run)
        return
    inner = sub.add_parser(entry.name, help=entry.help).add_subparsers(
        dest=f"command{depth + 1}", required=True
    )
    for command in entry.commands:
        _add(inner, command, depth + 1)


def parser() -> argparse.ArgumentParser:
    """The whole `inharness` command line, built from `COMMANDS`."""
    top = argparse.ArgumentParser(prog="inharness", description=__doc__.split("\n", 1)[0])
    sub = top.add_subparsers(dest="command", required=True)
    for entry in COMMANDS:
        _add(sub, entry, 0)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
