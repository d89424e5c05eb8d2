"""Tune the calc example's RL setting fast: the harness's agent loop imitated in one process.

Not the product path (that is `inharness run trainingrun.yaml`, which runs the unmodified harness.py
through the gateway). Here the same model, chat template, calculator tool, grader and training engine
run in-process with batched sampling, so one step of 32 rollouts takes ~12 s instead of ~38 s and a
learning-dynamics question (which learning rate, how many optimizer steps per batch) costs minutes.
It imitates the harness; it does not share its HTTP path, so check a setting it finds with a real run.

    python examples/calc/sim.py examples/calc/model --lr 1e-4 --steps 20
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grader  # noqa: E402
import harness  # noqa: E402
import tasks as calc_tasks  # noqa: E402

_CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>", re.S)


def _parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of the first tool call in `text`, as the gateway's parser would see it."""
    m = _CALL.search(text)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
        return str(call.get("name")), json.dumps(call.get("arguments"))
    except (ValueError, AttributeError):
        return "?", "{}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a warmed-up model (make demo writes examples/calc/model)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr-warmup", type=int, default=0, help="optimizer steps of linear lr warm-up")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    ap.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the warmed-up model")
    ap.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon (torch's default 1e-8)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from inharness.trainer.report import fifth_means
    from inharness.trainer.samples import Sample
    from inharness.trainer.torch_engine import TorchTrainingEngine, UpdateConfig

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = TorchTrainingEngine(
        args.model, learning_rate=args.lr, seed=args.seed, kl_reference=args.kl_coef > 0
    )
    for group in engine.optimizer.param_groups:
        group["eps"] = args.adam_eps
    config = UpdateConfig(
        loss_normalization="rollout",
        clip_ratio_high=0.28,
        ppo_mini_batches=args.mini_batches,
        ppo_epochs=args.epochs,
        kl_coef=args.kl_coef,
        lr_warmup_steps=args.lr_warmup,
        grad_clip=args.grad_clip,
    )
    rng = random.Random(args.seed)
    tasks = calc_tasks.load_tasks()

    def render(messages: list[dict[str, Any]]) -> list[int]:
        out = tok.apply_chat_template(messages, tools=[harness.CALC_TOOL], add_generation_prompt=True)
        return list(out["input_ids"]) if not isinstance(out, list) else out

    def sample(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = engine.model.generate(
                ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=harness.MAX_TOKENS, eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
        rows = out[:, width:].tolist()
        return [r[: r.index(eos) + 1] if eos in r else r for r in rows]

    rewards_per_step: list[float] = []
    started = time.monotonic()
    for step in range(args.steps):
        rollouts = [
            {"task": task, "group": f"{step}-{t}", "ids": [], "mask": [], "answer": None, "done": False,
             "right_op": False, "messages": [{"role": "system", "content": harness.SYSTEM},
                                             {"role": "user", "content": task["question"]}]}
            for t, task in enumerate(rng.sample(tasks, args.batch_size))
            for _ in range(args.group_size)
        ]  # fmt: skip
        for turn in range(harness.MAX_CALLS):
            live = []
            for r in rollouts:
                if r["done"]:
                    continue
                prompt = render(r["messages"])
                if prompt[: len(r["ids"])] != r["ids"]:  # cannot merge: the harness would split here
                    r["done"] = True
                    continue
                r["mask"] += [0] * (len(prompt) - len(r["ids"]))
                r["ids"] = prompt
                live.append(r)
            if not live:
                break
            for r, out in zip(live, sample([r["ids"] for r in live]), strict=True):
                r["ids"] = r["ids"] + out
                r["mask"] += [1] * len(out)
                call = _parse_call(tok.decode(out))
                if call is None:
                    r["done"], r["answer"] = True, tok.decode(out, skip_special_tokens=True)
                    continue
                content, _ = harness.run_tool(*call)
                if turn == 0:
                    r["right_op"] = content == str(r["task"]["answer"])
                fn = {"name": call[0], "arguments": call[1]}
                tool_call = {"id": f"c{turn}", "type": "function", "function": fn}
                r["messages"] += [
                    {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                    {"role": "tool", "tool_call_id": f"c{turn}", "content": content},
                ]
        samples = []
        for i, r in enumerate(rollouts):
            r["reward"] = grader.grade(r["task"], r["answer"])
            samples.append(
                Sample(rollout_id=f"{step}-{i}", group_id=r["group"], call_ids=[0], input_ids=r["ids"],
                       loss_mask=r["mask"], behaviour_logprobs=[0.0] * len(r["ids"]), model_versions=[step],
                       reward=r["reward"], num_prompt_tokens=0)
            )  # fmt: skip
        # Behaviour logprobs = the sampling policy's, as the inference engine would have recorded them.
        for s, lp in zip(samples, engine.logprobs(samples, temperature=1.0), strict=True):
            s.behaviour_logprobs = [0.0, *lp.tolist()]
        metrics = engine.update(samples, config)
        n = len(rollouts)
        rewards_per_step.append(sum(r["reward"] for r in rollouts) / n)
        outcomes: dict[str, set[float]] = {}
        for r in rollouts:
            outcomes.setdefault(r["group"], set()).add(r["reward"])
        mixed = sum(len(v) > 1 for v in outcomes.values()) / len(outcomes)
        print(
            f"step {step}: reward {rewards_per_step[-1]:.2f}"
            f" right-operator {sum(r['right_op'] for r in rollouts) / n:.2f}"
            f" tool-use {sum(len(r['messages']) > 2 for r in rollouts) / n:.2f}"
            f" mixed-groups {mixed:.2f}"
            f" entropy {metrics['entropy']:.3f} approx_kl {metrics['approx_kl']:.3f}"
            f" ({time.monotonic() - started:.0f}s)",
            flush=True,
        )
    first, last = fifth_means(rewards_per_step)
    print(f"first fifth {first:.3f}, last fifth {last:.3f}, gain {last - first:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
