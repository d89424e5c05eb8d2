"""`inharness`: the one console script. Each subcommand is a thin shell over a component's API."""

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from typing import Literal, get_args, get_origin

from inharness.engine import DEFAULT_PORT as ENGINE_PORT
from inharness.run import DEFAULT_MAX_CONSECUTIVE_FAILURES


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


GATEWAY_ENV_PREFIX = "INHARNESS_GATEWAY_"


def _gateway_flag(name: str) -> str:
    return "--engine" if name == "engines" else "--" + name.replace("_", "-")


def _gateway_parser(sub: argparse._SubParsersAction) -> None:
    """One flag per `GatewaySettings` field, generated, so that a new setting cannot lack one."""
    from inharness.gateway.settings import GatewaySettings

    p = sub.add_parser(
        "gateway",
        help="run the recording gateway (OpenAI-compatible API for harnesses, control API for the trainer)",
        description=f"Every flag also reads an env var, {GATEWAY_ENV_PREFIX}<FIELD> (e.g. "
        f"{GATEWAY_ENV_PREFIX}ADMIN_TOKEN; engines: {GATEWAY_ENV_PREFIX}ENGINES, comma-separated); "
        "a flag wins over its env var.",
    )
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


def _gateway_values(args: argparse.Namespace) -> dict[str, object]:
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


def _run_gateway(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from inharness.gateway.app import serve
    from inharness.gateway.settings import GatewaySettings

    values = _gateway_values(args)
    if "model" not in values:
        print(f"inharness gateway: --model (or {GATEWAY_ENV_PREFIX}MODEL) is required", file=sys.stderr)
        return 2
    if "admin_token" not in values:
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
    serve(settings)
    return 0


def _operator_parser(sub: argparse._SubParsersAction) -> None:
    op = sub.add_parser("operator", help="the Kubernetes operator").add_subparsers(
        dest="operator_command", required=True
    )
    run = op.add_parser(
        "run",
        help="reconcile TrainingRuns and RolloutPools (in-cluster service account, else KUBECONFIG)",
        description="Default images of the children: env INHARNESS_GATEWAY_IMAGE, INHARNESS_TRAINER_IMAGE.",
    )
    run.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    run.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    run.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics")
    run.add_argument("--liveness-port", type=int, default=8081, help="liveness probe /healthz")
    run.add_argument(
        "--resync-seconds",
        type=float,
        default=float(_env("INHARNESS_OPERATOR_RESYNC_SECONDS", "30") or 30),
        help="every run is re-converged this often, whether or not an event arrived",
    )
    run.add_argument(
        "--gateway-url",
        default=_env("INHARNESS_OPERATOR_GATEWAY_URL"),
        help="where a run's gateway answers, {name} and {namespace} filled in (progress for the status; "
        "default: the run's gateway Service)",
    )
    render = op.add_parser(
        "render",
        help="print the objects the operator creates for a spec file (YAML; for diff or kubectl apply)",
    )
    render.add_argument("file", help="YAML with the TrainingRun, its RolloutPool and HarnessSpec")
    render.add_argument(
        "--namespace", default=None, help="namespace of a run that names none (default: default)"
    )
    render.add_argument("--run", default=None, help="the TrainingRun to render when the file holds several")
    render.add_argument(
        "--admin-token",
        default=None,
        help="the gateway admin token to put in the Secret (default: a new one)",
    )
    crds = op.add_parser(
        "crds",
        help="write the CustomResourceDefinitions generated from the spec models (what `make crds` runs)",
    )
    crds.add_argument(
        "--out",
        action="append",
        default=None,
        help="directory to write to (repeatable; default: crds and charts/inharness/crds)",
    )
    crds.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming the files that are stale"
    )


def _run_operator(args: argparse.Namespace) -> int:
    if args.operator_command == "run":
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
    if args.operator_command == "render":
        from inharness.operator.render import RenderSettings, render_file
        from inharness.operator.specfile import SpecError

        extra = {"namespace": args.namespace} if args.namespace else {}
        try:
            out = render_file(
                args.file,
                settings=RenderSettings.from_env(**extra),
                admin_token=args.admin_token,
                run=args.run,
            )
        except SpecError as exc:
            print(f"inharness operator render: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(out)
        return 0
    if args.operator_command == "crds":
        from pathlib import Path

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
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inharness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(
        dest="model_command", required=True
    )
    tiny = model.add_parser("init-tiny", help="create a small random-init causal LM and tokenizer in DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)

    engine = sub.add_parser("engine", help="run the built-in CPU inference engine (vLLM-compatible subset)")
    engine.add_argument("--model", required=True)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=ENGINE_PORT)
    engine.add_argument("--served-model-name", default=None)
    engine.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, one per core); 1 where harnesses share the cores",
    )

    _gateway_parser(sub)
    _operator_parser(sub)

    run = sub.add_parser(
        "run", help="train locally from a spec file (TrainingRun + RolloutPool + HarnessSpec)"
    )
    run.add_argument("file", help="YAML with the TrainingRun, its RolloutPool and HarnessSpec")
    run.add_argument("--out", default=None, help="output directory (default: ./runs/<TrainingRun name>)")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    run.add_argument(
        "--max-consecutive-failures",
        type=int,
        default=DEFAULT_MAX_CONSECUTIVE_FAILURES,
        metavar="N",
        help="stop once N attempts in a row failed the same way before any model call "
        f"(default {DEFAULT_MAX_CONSECUTIVE_FAILURES}; 0: never)",
    )

    train = sub.add_parser(
        "train",
        help="the trainer of a TrainingRun on a cluster, against the run's gateway (what the operator runs)",
        description="Resumes from the last checkpoint in --out. The admin token comes from env "
        "INHARNESS_GATEWAY_ADMIN_TOKEN.",
    )
    train.add_argument("--config", required=True, help="the run's spec file (the ConfigMap's run.yaml)")
    train.add_argument("--out", required=True, help="work directory: checkpoints, weights, metrics")
    train.add_argument("--gateway-url", default=_env("INHARNESS_GATEWAY_URL"), help="the run's gateway")
    train.add_argument("--engine-host", default=_env("INHARNESS_ENGINE_HOST", "0.0.0.0"))
    train.add_argument("--engine-port", type=int, default=int(_env("INHARNESS_ENGINE_PORT") or ENGINE_PORT))
    train.add_argument(
        "--engine-url",
        default=_env("INHARNESS_ENGINE_URL"),
        help="this engine as the gateway reaches it (default: http://127.0.0.1:<engine port>)",
    )

    args = parser.parse_args(argv)
    if args.command == "model":
        from inharness.engine.tiny import init_tiny

        path = init_tiny(args.dir, seed=args.seed)
        print(path)
        return 0
    if args.command == "engine":
        from inharness.engine.server import serve

        if args.threads is not None and args.threads < 1:
            parser.error("--threads must be at least 1")

        serve(
            args.model, args.host, args.port, served_model_name=args.served_model_name, threads=args.threads
        )
        return 0
    if args.command == "gateway":
        return _run_gateway(args)
    if args.command == "operator":
        return _run_operator(args)
    if args.command == "train":
        from pathlib import Path

        from inharness.train import train_file

        token = _env("INHARNESS_GATEWAY_ADMIN_TOKEN")
        if not args.gateway_url or not token:
            print(
                "inharness train: needs --gateway-url (or INHARNESS_GATEWAY_URL) "
                "and INHARNESS_GATEWAY_ADMIN_TOKEN",
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
        )
    if args.command == "run":
        from pathlib import Path

        from inharness.run import run_file

        if args.max_consecutive_failures < 0:
            parser.error("--max-consecutive-failures must be 0 or more")
        return run_file(
            Path(args.file),
            Path(args.out) if args.out else None,
            resume=args.resume,
            max_consecutive_failures=args.max_consecutive_failures,
        )
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
