"""Prometheus metrics of the gateway, on a registry of its own (one per app, so tests don't collide)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inharness_gateway_requests", "Harness-facing requests", ["protocol", "status"], registry=r
        )
        self.latency = Histogram(
            "inharness_gateway_request_seconds",
            "Harness-facing request latency, engine included",
            ["protocol"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.tokens = Counter("inharness_gateway_tokens", "Tokens served", ["kind"], registry=r)
        self.in_flight = Gauge("inharness_gateway_in_flight", "Harness calls being answered", registry=r)
        self.held = Gauge("inharness_gateway_held", "Harness calls held by a serving pause", registry=r)
        self.queue_depth = Gauge("inharness_gateway_queue_depth", "Queued rollouts", registry=r)
        self.prefix_reused = Counter(
            "inharness_gateway_prefix_reused",
            "Turns whose prompt extends an earlier call token-exactly",
            registry=r,
        )
        self.prefix_mismatch = Counter(
            "inharness_gateway_prefix_mismatch",
            "Calls that extend no earlier call of their attempt (a new root of its call tree), by reason",
            ["reason"],
            registry=r,
        )
        self.calls_dropped = Counter(
            "inharness_gateway_calls_dropped",
            "Harness calls admitted but not recorded, since their harness cannot have received the "
            "answer (client_gone) or their attempt ended while they ran (attempt_ended)",
            ["reason"],
            registry=r,
        )
        self.engine_errors = Counter(
            "inharness_gateway_engine_errors", "Calls no engine could answer", registry=r
        )
        self.leases_expired = Counter(
            "inharness_gateway_leases_expired", "Attempts failed by lease expiry", registry=r
        )
