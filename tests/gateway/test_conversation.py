"""Conversation digests: prefixes identify earlier calls; SDK echo differences do not matter."""

from inharness.gateway.conversation import Conversation, FunctionCall, Message, extend_digest

TOOLS = ({"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}},)


def test_digest_of_request_plus_reply_equals_chain_of_the_next_request() -> None:
    first = Conversation((Message("user", "2+3?"),), TOOLS)
    reply = Message("assistant", "", (FunctionCall("calculator", '{"expression": "2+3"}'),))
    echoed = Message("assistant", "", (FunctionCall("calculator", '{"expression":"2+3"}'),), None)
    second = Conversation((*first.messages, echoed, Message("tool", "5", (), "call_1")), TOOLS)
    assert extend_digest(first.digest_chain()[-1], reply) == second.digest_chain()[2]


def test_digest_changes_with_tools_content_and_role() -> None:
    base = Conversation((Message("user", "hi"),), TOOLS).digest_chain()[-1]
    assert Conversation((Message("user", "hi"),), ()).digest_chain()[-1] != base
    assert Conversation((Message("user", "hi!"),), TOOLS).digest_chain()[-1] != base
    assert Conversation((Message("system", "hi"),), TOOLS).digest_chain()[-1] != base


def test_turns_chain_leaves_out_system_messages_and_tools() -> None:
    """A changed system prompt or tool list keeps the turns chain, so the gateway can tell it from a
    rewritten history (docs/gateway.md#calls-that-branch)."""
    turns = (Message("user", "2+3?"), Message("assistant", "5"), Message("user", "and 3+4?"))
    main = Conversation((Message("system", "Be brief."), *turns), TOOLS)
    summary = Conversation((Message("developer", "Summarise."), *turns), ())
    assert [k for k, _ in main.turns_chain()] == [2, 3, 4]
    assert [d for _, d in main.turns_chain()] == [d for _, d in summary.turns_chain()]
    assert main.digest_chain()[-1] != summary.digest_chain()[-1]
    edited = Conversation(
        (Message("system", "Be brief."), turns[0], Message("assistant", "6"), turns[2]), TOOLS
    )
    assert (
        edited.turns_chain()[0] == main.turns_chain()[0] and edited.turns_chain()[1] != main.turns_chain()[1]
    )
