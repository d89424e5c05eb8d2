"""The operator's Prometheus metrics, served on --metrics-port at /metrics."""

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

PHASES = ("Pending", "Running", "Suspended", "Complete", "Failed")


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "inharness_operator_reconciles_total",
            "Reconciles by kind and result (ok, error).",
            ["kind", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "inharness_operator_errors_total",
            "Errors while reconciling, by kind and error type.",
            ["kind", "error"],
            registry=self.registry,
        )
        self.runs = Gauge(
            "inharness_operator_training_runs",
            "TrainingRuns this operator reconciles, by phase.",
            ["phase"],
            registry=self.registry,
        )
        for phase in PHASES:
            self.runs.labels(phase=phase).set(0)

    def reconciled(self, kind: str, result: str) -> None:
        self.reconciles.labels(kind=kind, result=result).inc()

    def error(self, kind: str, error: str) -> None:
        self.errors.labels(kind=kind, error=error).inc()

    def set_phases(self, phases: Mapping[object, str]) -> None:
        counts = dict.fromkeys(PHASES, 0)
        for phase in phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.runs.labels(phase=phase).set(n)
