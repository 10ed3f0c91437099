"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own.

Counters of requests (by endpoint and status), histograms of time to first token, time per
output token and end-to-end latency (seconds), and — read from the engine at scrape time —
token totals, queue depth, running sequences and the expert load of every MoE layer
(``moelab_expert_tokens_total{layer, expert}``: routed pairs since start). An offloaded model
(ZipMoE) reports its expert-cache statistics through ``offload_stats``: a callable
returning ``{name: value}`` (e.g. ``{"hit_rate_full": 0.83}``), exported as
``moelab_offload_<name>`` gauges.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moelab.serve.engine import Engine, Sequence

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine: Engine, offload_stats: Callable[[], dict[str, float]] | None):
        self.engine, self.offload_stats = engine, offload_stats

    def collect(self):
        st = self.engine.stats
        yield CounterMetricFamily(
            "moelab_prompt_tokens", "Prompt tokens prefilled.", value=st.prompt_tokens
        )
        yield CounterMetricFamily(
            "moelab_generation_tokens", "Tokens generated.", value=st.generated_tokens
        )
        yield GaugeMetricFamily(
            "moelab_queue_depth", "Requests waiting for a slot.", value=self.engine.num_waiting
        )
        yield GaugeMetricFamily(
            "moelab_running_sequences", "Sequences decoding.", value=self.engine.num_running
        )
        yield GaugeMetricFamily(
            "moelab_max_batch", "Most sequences decoding at once.", value=self.engine.max_batch
        )
        load = CounterMetricFamily(
            "moelab_expert_tokens",
            "Routed (token, expert) pairs per MoE layer and expert since start.",
            labels=["layer", "expert"],
        )
        for layer, counts in zip(st.moe_layers, st.expert_counts, strict=True):
            for e, c in enumerate(counts):
                load.add_metric([str(layer), str(e)], c)
        yield load
        if self.offload_stats is not None:
            for name, value in self.offload_stats().items():
                yield GaugeMetricFamily(f"moelab_offload_{name}", f"Offload cache: {name}.", value)


class ServeMetrics:
    """The server's metrics; :meth:`render` gives the Prometheus text format."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(
        self, engine: Engine, offload_stats: Callable[[], dict[str, float]] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "moelab_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "moelab_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_TIME_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "moelab_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TIME_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "moelab_request_latency_seconds",
            "Arrival to the last token.",
            buckets=_TIME_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, offload_stats))

    def observe(self, seq: Sequence) -> None:
        """Record a finished sequence's timings."""
        if seq.ttft is not None:
            self.ttft.observe(seq.ttft)
        if seq.tpot is not None:
            self.tpot.observe(seq.tpot)
        if seq.finished_at is not None:
            self.latency.observe(seq.finished_at - seq.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
