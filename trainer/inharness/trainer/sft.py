"""Supervised warm-up on chat conversations, with the loss only on what the assistant itself produces.

Token sequences are built exactly as the engine sees them at inference: each prompt part is the tokenized
chat-template rendering up to the generation prompt, each assistant part is the tokenized remainder of its
turn up to and including ``<|im_end|>``. Spans come from rendering prefixes of the conversation, which is
exact because the chat template renders messages[:k] as a prefix of messages[:k+1].
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

IGNORE = -100


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = False,
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def build_example(
    tokenizer: PreTrainedTokenizerBase, conversation: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """Return (input_ids, labels) for one conversation; labels are IGNORE outside assistant turns."""
    messages: list[dict[str, Any]] = conversation["messages"]
    tools = conversation.get("tools") or None
    eos = tokenizer.eos_token
    ids: list[int] = []
    labels: list[int] = []
    done = 0  # characters of the full rendering already tokenized
    full = _render(tokenizer, messages, tools)

    def append(text: str, train: bool) -> None:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(piece)
        labels.extend(piece if train else [IGNORE] * len(piece))

    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], tools, generation_prompt=True) if i else ""
        turn = _render(tokenizer, messages[: i + 1], tools)
        if not (full.startswith(turn) and turn.startswith(prompt) and prompt[:done] == full[:done]):
            raise ValueError(f"chat template is not prefix-stable at message {i}")
        end = turn.rindex(eos) + len(eos)
        append(full[done : len(prompt)], train=False)
        append(full[len(prompt) : end], train=True)
        done = end
    append(full[done:], train=False)
    return ids, labels


def _batches(n: int, batch_size: int, rng: random.Random) -> list[list[int]]:
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def sft(
    model_dir: str | Path,
    conversations: list[dict[str, Any]],
    *,
    out_dir: str | Path,
    steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    batch_size: int = 8,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model_dir`` on ``conversations`` for ``steps`` optimizer steps and save to ``out_dir``.

    fp32 AdamW on CPU with a cosine-decayed learning rate (so a short run settles instead of oscillating);
    one step = one mini-batch of up to ``batch_size`` conversations, cycling through a seeded shuffle.
    Returns the first and last step's loss (mean token cross-entropy over assistant tokens).
    One function: the warm-up reads as one training loop, load to save, as a script would.
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    if not conversations:
        raise ValueError("need at least one conversation")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = [build_example(tokenizer, c) for c in conversations]
    if not any(label != IGNORE for _, labels in examples for label in labels):
        raise ValueError("no assistant tokens to train on")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        rng = random.Random(seed)
        pending: list[list[int]] = []
        losses: list[float] = []
        for step in range(steps):
            if not pending:
                pending = _batches(len(examples), batch_size, rng)
            batch = [examples[i] for i in pending.pop(0)]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            targets = torch.full((len(batch), width), IGNORE, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (ids, labels) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                targets[row, : len(labels)] = torch.tensor(labels)
                mask[row, : len(ids)] = 1
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
            shifted = targets[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=IGNORE
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if log is not None and (step == 0 or step == steps - 1 or (step + 1) % 10 == 0):
                log(f"sft step {step + 1}/{steps} loss {losses[-1]:.4f}")

    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"loss_first": losses[0], "loss_last": losses[-1], "steps": steps}
