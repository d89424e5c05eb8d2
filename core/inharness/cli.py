"""`inharness`: the one console script. Each subcommand is a thin shell over a component's API."""

import argparse
import os
import secrets
import sys
from collections.abc import Sequence


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _gateway_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the recording gateway (OpenAI-compatible API for harnesses, control API for the trainer)",
        description="Every flag also reads an env var, INHARNESS_GATEWAY_<FLAG> (engines: comma-separated).",
    )
    p.add_argument(
        "--model", default=_env("INHARNESS_GATEWAY_MODEL"), help="model dir (tokenizer, chat template)"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=None,
        help="engine base URL (repeatable); vLLM's OpenAI server or `inharness engine`",
    )
    p.add_argument(
        "--model-version", type=int, default=int(_env("INHARNESS_GATEWAY_MODEL_VERSION", "0") or 0)
    )
    p.add_argument("--store", default=_env("INHARNESS_GATEWAY_STORE", "sqlite:///inharness-gateway.db"))
    p.add_argument(
        "--sqlite-synchronous",
        choices=["normal", "full"],
        default=_env("INHARNESS_GATEWAY_SQLITE_SYNCHRONOUS", "normal"),
        help="normal: answered calls survive a killed gateway; full: also a power loss (fsync per commit)",
    )
    p.add_argument("--host", default=_env("INHARNESS_GATEWAY_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("INHARNESS_GATEWAY_PORT", "8000") or 8000))
    p.add_argument("--admin-token", default=_env("INHARNESS_GATEWAY_ADMIN_TOKEN"))
    p.add_argument("--served-model-name", default=_env("INHARNESS_GATEWAY_SERVED_MODEL_NAME"))
    p.add_argument(
        "--max-model-len",
        type=int,
        default=int(_env("INHARNESS_GATEWAY_MAX_MODEL_LEN", "0") or 0) or None,
        help="context length (default: the model config's max_position_embeddings)",
    )
    p.add_argument("--max-attempts", type=int, default=int(_env("INHARNESS_GATEWAY_MAX_ATTEMPTS", "3") or 3))
    p.add_argument(
        "--hold-seconds", type=float, default=float(_env("INHARNESS_GATEWAY_HOLD_SECONDS", "120") or 120)
    )


def _run_gateway(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from inharness.gateway.app import serve
    from inharness.gateway.settings import GatewaySettings

    engines = args.engine or [e for e in (_env("INHARNESS_GATEWAY_ENGINES") or "").split(",") if e]
    token = args.admin_token
    if not token:
        token = secrets.token_hex(24)
        print(f"no --admin-token given; generated one for this run: {token}", file=sys.stderr)
    if not args.model:
        print("inharness gateway: --model (or INHARNESS_GATEWAY_MODEL) is required", file=sys.stderr)
        return 2
    try:
        settings = GatewaySettings(
            model=args.model,
            engines=engines,
            model_version=args.model_version,
            store=args.store,
            sqlite_synchronous=args.sqlite_synchronous,
            host=args.host,
            port=args.port,
            admin_token=token,
            served_model_name=args.served_model_name,
            max_attempts=args.max_attempts,
            max_model_len=args.max_model_len,
            hold_seconds=args.hold_seconds,
        )
    except ValidationError as exc:
        print(f"inharness gateway: {exc}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


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
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--served-model-name", default=None)

    _gateway_parser(sub)

    run = sub.add_parser(
        "run", help="train locally from a spec file (TrainingRun + RolloutPool + HarnessSpec)"
    )
    run.add_argument("file", help="YAML with the TrainingRun, its RolloutPool and HarnessSpec")
    run.add_argument("--out", default=None, help="output directory (default: ./runs/<TrainingRun name>)")
    run.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")

    args = parser.parse_args(argv)
    if args.command == "model":
        from inharness.engine.tiny import init_tiny

        path = init_tiny(args.dir, seed=args.seed)
        print(path)
        return 0
    if args.command == "engine":
        from inharness.engine.server import serve

        serve(args.model, args.host, args.port, served_model_name=args.served_model_name)
        return 0
    if args.command == "gateway":
        return _run_gateway(args)
    if args.command == "run":
        from pathlib import Path

        from inharness.run import run_file

        return run_file(Path(args.file), Path(args.out) if args.out else None, resume=args.resume)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
