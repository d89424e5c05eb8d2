"""The inharness gateway: an OpenAI-compatible proxy that records every model call token-exactly.

Harnesses talk to it as if it were their model provider; the trainer and operator use its control
API (rollout queue with leases, recorded calls, model versions, serving pause/resume).
"""
