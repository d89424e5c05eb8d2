"""Harness-facing protocol adapters over one internal call record.

Each adapter turns its wire format into a `Conversation` and sampling settings, lets
`inharness.gateway.calls` generate and record, and renders the answer in its own format.
OpenAI Chat Completions is here; OpenAI Responses (Codex) and Anthropic Messages (Claude Code)
plug in beside it.
"""
