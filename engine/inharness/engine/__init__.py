"""Inference engine: a tiny offline model, a token-in/token-out sampler and a vLLM-compatible server."""
