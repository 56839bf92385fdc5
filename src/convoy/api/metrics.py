"""Prometheus metrics and the per-request record behind the one INFO log line per request.

Engine figures (running and waiting sequences, KV blocks, token totals) are read from
`engine.stats()` when /metrics is scraped: a snapshot of the engine's own counts that the engine
thread takes after each step (reading its live dicts from here would race with that thread).
HTTP figures (requests by route and status, latency histograms) are recorded by the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from convoy.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(slots=True)
class RequestRecord:
    """What one HTTP request did; the middleware logs it once, when the response is complete."""

    request_id: str
    start: float = field(default_factory=time.monotonic)
    api_id: str | None = None  # cmpl-... / chatcmpl-... for generation requests
    num_prompts: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    # predicted outputs: the prediction's draft tokens kept / rejected (None: no prediction)
    num_accepted_prediction_tokens: int | None = None
    num_rejected_prediction_tokens: int | None = None
    first_token_time: float | None = None

    def mark_first_token(self, when: float) -> None:
        """`when` is on the time.monotonic() clock (the engine's metrics use it too)."""
        if self.first_token_time is None or when < self.first_token_time:
            self.first_token_time = when

    def describe(self) -> str:
        if self.api_id is None:
            return ""
        return (
            f" id={self.api_id} prompts={self.num_prompts} prompt_tokens={self.num_prompt_tokens}"
            f" completion_tokens={self.num_completion_tokens}"
            f" cached_tokens={self.num_cached_tokens}"
        )


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _gauge(
            "convoy_num_requests_running", "Sequences in the running batch.", s.num_running
        )
        yield _gauge(
            "convoy_num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting
        )
        yield _gauge("convoy_kv_blocks_used", "KV cache blocks in use.", s.num_kv_blocks_used)
        yield _gauge(
            "convoy_kv_blocks_total", "KV cache blocks in the pool.", s.num_kv_blocks_total
        )
        yield _gauge(
            "convoy_engine_requests_in_flight",
            "Engine requests (one per prompt) the server is waiting on.",
            self._in_flight(),
        )
        yield _counter("convoy_prompt_tokens", "Prompt tokens processed.", s.num_prompt_tokens)
        yield _counter(
            "convoy_generation_tokens", "Generation tokens produced.", s.num_generation_tokens
        )
        yield _counter("convoy_preemptions", "Sequences preempted.", s.num_preemptions)
        yield _counter(
            "convoy_side_steps",
            "Steps of new requests' prompts run between two layers of a longer step.",
            s.num_side_steps,
        )
        yield _counter(
            "convoy_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            s.num_prefix_cache_hit_tokens,
        )
        yield _counter(
            "convoy_spec_decode_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            s.num_draft_tokens,
        )
        yield _counter(
            "convoy_spec_decode_accepted_tokens",
            "Speculative decoding: draft tokens kept.",
            s.num_accepted_draft_tokens,
        )
        yield _counter(
            "convoy_spec_decode_rejected_tokens",
            "Speculative decoding: draft tokens rejected.",
            s.num_draft_tokens - s.num_accepted_draft_tokens,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class _Labelled(Collector):
    """Every sample of `inner` with `labels` added: a Serve replica's id on all its metrics, so
    the replicas behind one endpoint can be told apart (and summed) by a scraper."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self._inner = inner
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for metric in self._inner.collect():  # fresh Metric objects each time: ours to change
            metric.samples = [
                s._replace(labels={**s.labels, **self._labels}) for s in metric.samples
            ]
            yield metric


class ServerMetrics:
    """One registry per app, so building two apps in one process never collides.

    `labels` (a Serve replica's id) are added to every sample /metrics shows.
    """

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry()
        self._shown = self.registry
        if labels:
            self._shown = CollectorRegistry()
            self._shown.register(_Labelled(self.registry, labels))
        self.requests = Counter(
            "convoy_http_requests",
            "HTTP requests by route and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "convoy_e2e_request_latency_seconds",
            "Generation request latency, arrival to last byte.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "convoy_time_to_first_token_seconds",
            "Arrival to the first generated token (end of request when not streaming).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def attach_engine(self, stats: Callable[[], EngineStats], in_flight: Callable[[], int]) -> None:
        self.registry.register(_EngineCollector(stats, in_flight))

    def observe(self, route: str, method: str, status: int, record: RequestRecord) -> None:
        self.requests.labels(route, method, str(status)).inc()
        if record.api_id is None:
            return
        self.e2e_latency.labels(route).observe(time.monotonic() - record.start)
        if record.first_token_time is not None:
            self.ttft.labels(route).observe(record.first_token_time - record.start)

    def render(self) -> bytes:
        return generate_latest(self._shown)
