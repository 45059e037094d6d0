"""Prometheus metrics of one app: HTTP-side histograms and counters, engine counters by tier.

Two sources, one ``CollectorRegistry`` per app (built in ``create_app``, no global registry):

- the HTTP layer observes what only it sees: requests by endpoint, status and streaming
  (an ASGI middleware), time to first token, time per output token and end-to-end latency of
  chat completions, finish reasons;
- ``EngineCollector`` reads the engine's own counters at scrape time
  (``MetricsSource.metrics_snapshot``): prefix-cache queries and hits in tokens per tier, miss
  reasons, vision-cache queries and hits, and per cache and tier the resident bytes, budget,
  entries, evictions, spills, drops, promotions and quarantined files. The engine owns those
  values; a scrape copies plain counters and never queues behind a request or runs MLX work.

No metric carries a tenant label: tenant ids must not leak into a monitoring system, and
per-tenant series would grow without bound. Per-tenant numbers are in ``/v1/cache/stats``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.api.completion import CompletionItem, Outcome
from server.engine.metrics_snapshot import EngineSnapshot, MetricsSource
from server.engine.types import EngineError

PREFIX = "vlmcache"
# Text format 0.0.4 (every name here is a legacy-safe identifier, so every Prometheus version
# reads it); the web framework appends the charset.
CONTENT_TYPE = "text/plain; version=0.0.4"

# Seconds; CPU prefill of thousands of tokens takes tens of seconds, a cached turn milliseconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# Path -> endpoint label: a closed set, so label values cannot grow with client input.
_ENDPOINTS = (
    ("/v1/chat/completions", "chat_completions"),
    ("/v1/cache/stats", "cache_stats"),
    ("/v1/models", "models"),
    ("/health", "health"),
    ("/metrics", "metrics"),
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def endpoint_label(path: str) -> str:
    """The endpoint label of a request path (``other`` for anything unknown)."""
    for prefix, label in _ENDPOINTS:
        if path == prefix or path.startswith(prefix + "/"):
            return label
    return "other"


class EngineCollector(Collector):
    """Turns the bound engine's ``EngineSnapshot`` into metric families at scrape time."""

    def __init__(self) -> None:
        self._engine: MetricsSource | None = None

    def bind(self, engine: object) -> None:
        """Read this engine from now on (an engine that is not a ``MetricsSource`` gives none)."""
        self._engine = engine if isinstance(engine, MetricsSource) else None

    def unbind(self) -> None:
        self._engine = None

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering does not call collect() before an engine exists.
        return [family for family in _families(None)]

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        if engine is None:
            return []
        return _families(engine.metrics_snapshot())


def _families(snap: EngineSnapshot | None) -> list[Metric]:
    def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))

    requests = counter("engine_requests", "Requests the engine prefilled.")
    prompt = counter("prompt_tokens", "Prompt tokens of those requests.")
    generated = counter("generation_tokens", "Tokens generated.")
    queries = counter("prefix_cache_queries_tokens",
                      "Prompt tokens looked up in each tier of the prefix cache (a lower tier is "
                      "asked for what the tiers above did not hold).", ("tier",))
    hits = counter("prefix_cache_hits_tokens",
                   "Prompt tokens restored from each tier of the prefix cache (the sum over "
                   "tiers is usage.prompt_tokens_details.cached_tokens).", ("tier",))
    hit_blocks = counter("prefix_cache_hit_blocks", "Full blocks matched by lookups.")
    miss_blocks = counter("prefix_cache_miss_blocks",
                          "Full blocks a lookup could have matched but did not, by reason.",
                          ("reason",))
    rolling = gauge("prefix_cache_rolling_block_hit_rate",
                    "Block hit rate over the low-hit-rate warning window.")
    warnings = counter("prefix_cache_hit_rate_warnings", "Low-hit-rate warnings logged.")
    vq = counter("vision_cache_queries", "Images whose encoder features were needed.")
    vh = counter("vision_cache_hits", "Of those, found in the vision feature cache.")
    runs = counter("vision_encoder_runs", "Vision tower runs.")
    tier_labels = ("cache", "tier")
    resident = gauge("cache_resident_bytes", "Bytes held now.", tier_labels)
    budget = gauge("cache_budget_bytes", "Byte budget.", tier_labels)
    entries = gauge("cache_entries", "Blocks or feature entries held now.", tier_labels)
    evictions = counter("cache_evictions", "Entries evicted to make room.", tier_labels)
    spills = counter("cache_spills", "Entries written down to this tier.", tier_labels)
    drops = counter("cache_drops", "Entries refused or lost without being stored in this tier "
                    "(RAM: everything else pinned; SSD: write queue full).", tier_labels)
    promotions = counter("cache_promotions", "Entries read from this tier back into RAM.",
                         tier_labels)
    quarantined = counter("cache_quarantined", "Corrupt files moved to quarantine.", tier_labels)
    families: list[Metric] = [requests, prompt, generated, queries, hits, hit_blocks, miss_blocks,
                              rolling, warnings, vq, vh, runs, resident, budget, entries,
                              evictions, spills, drops, promotions, quarantined]
    if snap is None:
        return families
    requests.add_metric([], snap.requests)
    prompt.add_metric([], snap.prompt_tokens)
    generated.add_metric([], snap.completion_tokens)
    # Tiers are asked top down: each lower tier sees what the ones above did not hit.
    asked = snap.prompt_tokens
    kv_tiers = list(dict.fromkeys(["ram", *(t.tier for t in snap.tiers)]))
    for tier in kv_tiers:
        hit = snap.hit_tokens_by_tier.get(tier, 0)
        queries.add_metric([tier], asked)
        hits.add_metric([tier], hit)
        asked -= hit
    hit_blocks.add_metric([], snap.hit_blocks)
    for reason, count in snap.miss_blocks.items():
        miss_blocks.add_metric([reason], count)
    if snap.rolling_block_hit_rate is not None:
        rolling.add_metric([], snap.rolling_block_hit_rate)
    warnings.add_metric([], snap.hit_rate_warnings)
    vq.add_metric([], snap.vision_queries)
    vh.add_metric([], snap.vision_hits)
    runs.add_metric([], snap.encoder_runs)
    for t in snap.tiers:
        key = [t.cache, t.tier]
        resident.add_metric(key, t.resident_bytes)
        if t.budget_bytes is not None:
            budget.add_metric(key, t.budget_bytes)
        entries.add_metric(key, t.entries)
        evictions.add_metric(key, t.evictions)
        spills.add_metric(key, t.spills)
        drops.add_metric(key, t.drops)
        promotions.add_metric(key, t.promotions)
        quarantined.add_metric(key, t.quarantined)
    return families


class ServerMetrics:
    """The registry of one app and the metrics the HTTP layer observes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests by endpoint, status code and streaming.",
            ["endpoint", "status", "stream"], registry=self.registry)
        self.completions = Counter(
            f"{PREFIX}_completions", "Chat completions by how they ended.", ["finish_reason"],
            registry=self.registry)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From the request reaching the chat handler to its first generated token.",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per generated token after the first, per completion.",
            buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From the request reaching the chat handler to its last token.",
            buckets=E2E_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """The exposition text of every metric (Prometheus text format)."""
        return generate_latest(self.registry)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Litestar middleware factory: counts every response by endpoint, status, stream."""
        requests = self.requests

        async def count_requests(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            seen: dict[str, str] = {}

            async def watch(message: Message) -> None:
                if message["type"] == "http.response.start":
                    seen["status"] = str(message["status"])
                    content_type = b""
                    for name, value in message.get("headers", ()):
                        if name.lower() == b"content-type":
                            content_type = value
                    streamed = content_type.startswith(b"text/event-stream")
                    seen["stream"] = "true" if streamed else "false"
                await send(message)

            try:
                await app(scope, receive, watch)
            finally:
                requests.labels(endpoint_label(scope["path"]), seen.get("status", "500"),
                                seen.get("stream", "false")).inc()

        return count_requests

    async def observe_completion(
        self, items: AsyncIterator[CompletionItem], started: float
    ) -> AsyncIterator[CompletionItem]:
        """Pass ``items`` through, timing the first token and the whole completion.

        Args:
            items: A completion's items (``completion_items``).
            started: ``time.perf_counter()`` when the request reached the handler.
        """
        first: float | None = None
        try:
            async for item in items:
                if isinstance(item, str) and first is None:
                    first = time.perf_counter()
                    self.ttft.observe(first - started)
                elif isinstance(item, Outcome):
                    self._finished(item, started, first)
                elif isinstance(item, EngineError):
                    self.completions.labels("error").inc()
                yield item
        finally:
            await items.aclose()  # type: ignore[attr-defined]

    def _finished(self, outcome: Outcome, started: float, first: float | None) -> None:
        end = time.perf_counter()
        tokens = outcome.usage.completion_tokens
        if first is None and tokens > 0:
            # The only token ended the completion (no text): it still was the first token.
            first = end
            self.ttft.observe(first - started)
        if first is not None and tokens > 1:
            self.tpot.observe((end - first) / (tokens - 1))
        self.e2e.observe(end - started)
        self.completions.labels(outcome.finish_reason).inc()
