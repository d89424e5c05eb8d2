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
