"""A continuation's prompt renders the chat template twice, not three times: its "history before the
reply" is its parent's whole prompt, kept from when the parent was built, and the ids are the same as
when every text is rendered afresh."""

import asyncio
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from inharness.gateway.conversation import Conversation, Message, extend_digest
from inharness.gateway.prompts import BuiltPrompt, PromptBuilder, _Rendered
from inharness.gateway.store import ParentCall, Store

ATTEMPT = "att-1"


def _conversations() -> tuple[Conversation, Message, Conversation]:
    first = Conversation(
        messages=(Message("system", "Use the calculator."), Message("user", "What is 2+3?")),
    )
    reply = Message("assistant", "It is 5.")
    second = Conversation(messages=(*first.messages, reply, Message("user", "And 5+5?")))
    return first, reply, second


async def _second_prompt(tool_model: Path, tmp_path: Path, *, keep: bool) -> tuple[BuiltPrompt, list[int]]:
    """The second turn's prompt, and how many renders each turn took."""
    tok = AutoTokenizer.from_pretrained(tool_model)
    renders = [0]
    plain = tok.apply_chat_template

    def counted(*args: Any, **kwargs: Any) -> Any:
        renders[0] += 1
        return plain(*args, **kwargs)

    tok.apply_chat_template = counted
    store = await Store.open(f"sqlite:///{tmp_path / ('keep' if keep else 'fresh')}.db")
    try:
        builder = PromptBuilder(tok, store)
        renders[0] = 0  # the builder's own check of the tokenizer at start
        if not keep:
            builder._rendered = _Rendered(max_chars=0)  # keeps nothing: every text rendered afresh
        first, reply, second = _conversations()
        chain = first.digest_chain()
        built = await builder.build(ATTEMPT, first, chain)
        per_turn = [renders[0]]
        reply_ids = [*builder.encode(reply.content), tok.eos_token_id]
        parent = ParentCall(1, built.ids, reply_ids, "stop")
        builder.remember(ATTEMPT, 1, chain[-1], extend_digest(chain[-1], reply), built.turns_digest, parent)
        got = await builder.build(ATTEMPT, second, second.digest_chain())
        per_turn.append(renders[0] - per_turn[0])
        return got, per_turn
    finally:
        await store.close()


def test_a_continuation_renders_twice_and_builds_the_same_ids(tool_model: Path, tmp_path: Path) -> None:
    kept, kept_renders = asyncio.run(_second_prompt(tool_model, tmp_path, keep=True))
    fresh, fresh_renders = asyncio.run(_second_prompt(tool_model, tmp_path, keep=False))
    assert kept.prefix_reused and kept.parent_call_id == 1 and kept.mismatch is None
    assert kept.ids == fresh.ids
    assert fresh_renders == [1, 3]  # the whole conversation, the history, the history before the reply
    assert kept_renders == [1, 2]
