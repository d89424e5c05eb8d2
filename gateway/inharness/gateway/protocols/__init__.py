"""Harness-facing protocol adapters over one internal call record.

Each adapter turns its wire format into a `Conversation` and sampling settings, lets
`inharness.gateway.calls` generate and record, and renders the answer in its own format:
`openai_chat` (Chat Completions), `openai_responses` (Responses: Codex CLI), `anthropic_messages`
(Messages: Claude Code), each with its request models beside it. What they share (the key, the call
skeleton, decoding a choice into text and tool calls, SSE framing) is in `common`; the tool-call
codec is `inharness.gateway.toolcalls` (model text -> calls) and `conversation` (calls -> template).
"""
