"""Inference engine: a tiny offline model, a token-in/token-out sampler and a vLLM-compatible server."""

DEFAULT_PORT = 8001
"""The engine's port: `inharness engine`'s default and the trainer pod's (the gateway's is 8000)."""

TINY_CONTEXT = 2048
"""`inharness model init-tiny`'s default context in tokens: enough for the calc example; a real
harness's first prompt needs more (`--context 65536`)."""
