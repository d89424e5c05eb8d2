"""The operator: TrainingRun, RolloutPool and HarnessSpec as pydantic spec models (the single source
of the CRDs), spec-file loading for local runs, the kopf handlers, and rollout controllers that run
one harness per claimed attempt (local processes, or Kubernetes pods behind the same interface)."""
