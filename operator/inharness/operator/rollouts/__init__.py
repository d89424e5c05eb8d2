"""Rollout controllers: claim queued attempts of one pool from the gateway, run one harness per
attempt, and report each outcome.

- `base`: `ClaimingController`, the claim loop, leases, reporting and counting with hooks for what a
  backend does differently, and the one retry policy (`retry`, `backoff`);
- `outcome`: `Outcome`, the result JSON rules, and the classification of a harness pod as a table;
- `local`: harnesses as child processes; `kubernetes`: harnesses as pods (or Jobs) of a cluster.

Callers depend on `RolloutBackend` alone.
"""

from inharness.operator.rollouts.base import (
    Abort,
    ClaimingController,
    Detached,
    OnFinish,
    OnReport,
    Outage,
    Report,
    RolloutBackend,
    RunnerFault,
    backoff,
    retry,
)
from inharness.operator.rollouts.outcome import (
    FIXES,
    REWARD_MISSING,
    NoReward,
    Outcome,
    fix_for,
    parse_result,
    reason_key,
)

__all__ = [
    "FIXES",
    "REWARD_MISSING",
    "Abort",
    "ClaimingController",
    "Detached",
    "NoReward",
    "OnFinish",
    "OnReport",
    "Outage",
    "Outcome",
    "Report",
    "RolloutBackend",
    "RunnerFault",
    "backoff",
    "fix_for",
    "parse_result",
    "reason_key",
    "retry",
]
