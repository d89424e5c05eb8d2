"""The demo's premise, measured: the warmed-up model writes mini's tool call and names the word, but
picks the answer about one time in four, so that only RL can raise the reward.

    python examples/mini-swe-agent/premise.py runs/mini-swe-agent-demo/teacher examples/mini-swe-agent/model

For each task, the teacher's recorded prompt of the answering turn (mini's prompt, the agent's
`cat word.txt` and its output: the exact tokens the harness sent) is sampled `--samples` times at
temperature 1 (the spec's) with the model's own `generate`. A sample is well-formed when it is the
teacher's turn with some word and some answer; it names the word when the word is the task's; it is
right when the answer is. demo.py records the result in demo.json.

`word_sensitivity` says whether the model reads the word at all: the next-token distribution after the
teacher's `The word is "`, on each task's prompt, and the largest total-variation distance between two
tasks' distributions (0: the model's choice of word does not depend on which word it was shown).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import family  # noqa: E402

TURN = re.compile(
    r'The word is "(\w+)"\.\n<tool_call>\n\{"name": "bash", "arguments": \{"command": '
    r'"echo (\w+) > ' + re.escape(family.ANSWER_FILE) + r'"\}\}\n</tool_call>'
)
OUTPUT = re.compile(r'"output": "(\w+)\\n"')


def answering_prompts(teacher_run: Path, tokenizer: Any) -> dict[str, list[int]]:
    """word -> the token ids of the teacher's prompt for its answering turn (the second learnt turn)."""
    from inharness.trainer.warmup import read_rollouts, select, store_url_of

    prompts: dict[str, list[int]] = {}
    for sample in select(asyncio.run(read_rollouts(store_url_of(str(teacher_run)))), None).samples:
        mask = sample.loss_mask
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        if len(starts) < 2:
            continue
        ids = sample.input_ids[: starts[1]]
        found = OUTPUT.findall(tokenizer.decode(ids))
        if found and found[-1] in family.OPPOSITES:
            prompts.setdefault(found[-1], ids)
    return prompts


def measure(teacher_run: Path, model_dir: Path, samples: int = 32, seed: int = 0) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = answering_prompts(teacher_run, tokenizer)
    if set(prompts) != set(family.OPPOSITES):
        raise SystemExit(f"premise: the recording has answering prompts for {sorted(prompts)} only")
    torch.manual_seed(seed)
    counts = {"samples": 0, "well_formed": 0, "named": 0, "right": 0}
    names: dict[str, dict[str, int]] = {}  # per task's word: the words its well-formed samples named
    for word, ids in sorted(prompts.items()):
        x = torch.tensor([ids] * samples)
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=80,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        for row in out[:, len(ids) :]:
            counts["samples"] += 1
            turn = TURN.fullmatch(tokenizer.decode(row, skip_special_tokens=True).strip())
            if turn:
                counts["well_formed"] += 1
                counts["named"] += turn.group(1) == word
                names.setdefault(word, {}).setdefault(turn.group(1), 0)
                names[word][turn.group(1)] += 1
                counts["right"] += turn.group(2) == family.OPPOSITES[word]
    n = counts["samples"]
    rates = {f"{k}_rate": counts[k] / n for k in ("well_formed", "named", "right")}
    sensitivity = word_sensitivity(model, tokenizer, prompts)
    return {**counts, **rates, "names": names, "word_sensitivity": sensitivity}


NAMING = 'The word is "'  # the teacher's thought up to the word (family.teacher_script)


def word_sensitivity(model: Any, tokenizer: Any, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Per task's word, the model's five likeliest next tokens after `NAMING` on its answering prompt, and
    the largest total-variation distance between two tasks' next-token distributions."""
    import torch

    suffix = tokenizer.encode(NAMING, add_special_tokens=False)
    dists: dict[str, Any] = {}
    with torch.no_grad():
        for word, ids in sorted(prompts.items()):
            dists[word] = model(torch.tensor([ids + suffix])).logits[0, -1].float().softmax(-1)
    words = list(dists)
    tv = max(
        (0.5 * float((dists[a] - dists[b]).abs().sum()) for i, a in enumerate(words) for b in words[i + 1 :]),
        default=0.0,
    )
    top = {
        w: [[tokenizer.decode([int(i)]), round(float(v), 3)] for v, i in zip(*d.topk(5), strict=True)]
        for w, d in dists.items()
    }
    return {"max_total_variation": tv, "top": top}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("teacher_run", type=Path, help="the teacher's run directory (its gateway.db)")
    p.add_argument("model", type=Path, help="the warmed-up model directory")
    p.add_argument("--samples", type=int, default=32, help="samples per task")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.teacher_run, args.model, args.samples), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
