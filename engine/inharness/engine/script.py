"""Scripted completions: the engine answers with given tokens instead of sampled ones.

A random tiny model never calls a tool, so a test of a real harness (Codex CLI, Claude Code,
mini-SWE-agent) could never see that harness execute a tool and send its result back. In scripted mode
(`inharness engine --script FILE`, or ``INHARNESS_ENGINE_SCRIPT=FILE`` in the environment of
`inharness run`, which starts the engine itself) the engine still runs the model over the prompt and
each scripted token, reports the model's logprob of every token, batches and caches prefixes as usual,
and stops at a stop token, a stop string or ``max_tokens`` as usual: only the choice of the next token
is taken from the script. The recorded calls are therefore what a model that wrote these tokens would
have produced, token for token, logprobs included, and train as such.

The file is JSON::

    {"scripts": [
        {"when": "Generate a title", "turns": ["A title"]},
        {"turns": ["<tool_call>\\n{\\"name\\": \\"Bash\\", ...}\\n</tool_call>", "Done."]}
    ]}

or just the list of turns of one script (``["...", "..."]``). A request takes the first script whose
``when`` (absent: always) occurs in its decoded prompt, and the turn numbered by the assistant turns its
prompt already holds (``<|im_start|>assistant`` markers before the generation prompt); past the last
turn, the last is repeated. So the choice depends only on the prompt: concurrent attempts, retries and
their interleaving get the same answers. A turn is text (tokenised by the served tokenizer, the end-of-
turn token appended) or ``{"token_ids": [...]}``, taken as is.

The one exception is a turn ``{"cycle": [turn, ...]}``: the requests that reach it take its alternatives
in turn (the k-th gets alternative ``k mod n``), so that n attempts of one prompt record each alternative
once, whatever their interleaving. A teacher whose answers must not depend on the prompt (a warm-up that
teaches a harness's format but leaves the task's answer to the reward) is written so.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

SCRIPT_ENV = "INHARNESS_ENGINE_SCRIPT"
"""The environment variable the engine reads a script path from when no ``--script`` is given."""

ASSISTANT_MARK = "<|im_start|>assistant"


class Cycle:
    """A turn whose requests take its alternatives in turn (thread-safe: the engine serves concurrently)."""

    def __init__(self, alternatives: tuple[tuple[int, ...], ...]) -> None:
        self.alternatives = alternatives
        self._served = 0
        self._lock = threading.Lock()

    def next(self) -> tuple[int, ...]:
        with self._lock:
            k, self._served = self._served, self._served + 1
        return self.alternatives[k % len(self.alternatives)]


@dataclass(frozen=True)
class Script:
    when: str | None
    turns: tuple[tuple[int, ...] | Cycle, ...]


class Scripts:
    """The loaded scripts of one engine; ``tokens_for(prompt)`` picks a prompt's answer."""

    def __init__(self, scripts: list[Script], tokenizer: PreTrainedTokenizerBase, path: str) -> None:
        self.scripts, self.tokenizer, self.path = scripts, tokenizer, path

    @classmethod
    def load(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Scripts:
        """Read and check ``path``; ValueError naming the file and the entry when it is malformed."""
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read the engine script: {exc}") from exc
        raw = doc.get("scripts") if isinstance(doc, dict) else [{"turns": doc}]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f'{path}: expected a list of turns or {{"scripts": [...]}} with at least one')
        end = tokenizer.eos_token_id
        scripts = []
        for i, entry in enumerate(raw):
            where = f"{path}: scripts[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("turns"), list) or not entry["turns"]:
                raise ValueError(f"{where}: needs a non-empty list 'turns'")
            when = entry.get("when")
            if when is not None and not (isinstance(when, str) and when):
                raise ValueError(f"{where}.when: must be a non-empty string")
            turns = tuple(
                _turn(t, tokenizer, end, vocab_size, f"{where}.turns[{k}]")
                for k, t in enumerate(entry["turns"])
            )
            scripts.append(Script(when=when, turns=turns))
        return cls(scripts, tokenizer, str(path))

    def tokens_for(self, prompt_ids: list[int]) -> tuple[int, ...]:
        """The scripted answer to ``prompt_ids`` (an empty tuple when no script's ``when`` matches: the
        engine then samples)."""
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        script = next((s for s in self.scripts if s.when is None or s.when in prompt), None)
        if script is None:
            return ()
        turn = max(prompt.count(ASSISTANT_MARK) - int(prompt.rstrip().endswith(ASSISTANT_MARK)), 0)
        chosen = script.turns[min(turn, len(script.turns) - 1)]
        return chosen.next() if isinstance(chosen, Cycle) else chosen


def _turn(
    turn: Any, tokenizer: PreTrainedTokenizerBase, end: int | None, vocab_size: int, where: str
) -> tuple[int, ...] | Cycle:
    if isinstance(turn, dict) and "cycle" in turn:
        options = turn["cycle"]
        if not isinstance(options, list) or not options:
            raise ValueError(f"{where}.cycle: needs a non-empty list of turns")
        return Cycle(
            tuple(
                _tokens(t, tokenizer, end, vocab_size, f"{where}.cycle[{k}]") for k, t in enumerate(options)
            )
        )
    return _tokens(turn, tokenizer, end, vocab_size, where)


def _tokens(
    turn: Any, tokenizer: PreTrainedTokenizerBase, end: int | None, vocab_size: int, where: str
) -> tuple[int, ...]:
    if isinstance(turn, str):
        ids = list(tokenizer.encode(turn, add_special_tokens=False))
        return tuple([*ids, end] if end is not None else ids)
    ids = turn.get("token_ids") if isinstance(turn, dict) else None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
    ):
        raise ValueError(f"{where}: must be text or {{'token_ids': [ids below {vocab_size}]}}")
    return tuple(ids)
