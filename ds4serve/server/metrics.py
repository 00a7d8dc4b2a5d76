"""Prometheus metrics: what users feel (TTFT, inter-token latency) and what the engine holds.

Engine-side figures (queue, running, suspended, parked, slots, pages, passes, preemptions, decode
width, the prefix cache) are read at scrape time from ``EngineLoop.stats``: the ``EngineStats``
snapshot the core publishes on the engine-loop thread after every step, so a scrape never touches a
core, a scheduler or a cache. Latency histograms are observed by the
request handlers on the event loop; error and cancellation counters by the access-log middleware.

Every series carries a ``model_name`` label (the served name), so dashboards that scrape several
servers, or compare against vLLM's metrics, can tell them apart. The per-request counters (tokens,
outcomes, errors, cancellations, rejections) also carry ``key_name``: the configured name of the API
key the request came with, so its cardinality is the number of configured keys (never a key, never
anything a client chose). Prometheus stores an empty label as no label, so a server without keys
exports the same series as before the label existed.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..runtime import DECODE_WIDTH_WINDOW, EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
KEY_NOTE = ("; key_name: the API key's configured name (empty on a server without keys, or for a request "
            "refused before a key matched)")

_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {  # name: (help, its figure)
    "ds4serve_queue_depth": ("requests waiting for a slot", lambda s: s.requests["waiting"]),
    "ds4serve_requests_running": ("requests holding a slot (prefilling or decoding)", lambda s: s.running),
    "ds4serve_requests_prefilling": ("requests prefilling", lambda s: s.requests["prefilling"]),
    "ds4serve_requests_suspended": ("requests suspended to host memory", lambda s: s.requests["suspended"]),
    "ds4serve_requests_parked": ("requests dropped, waiting to be recomputed", lambda s: s.requests["parked"]),
    "ds4serve_slots_in_use": ("sequence slots in use", lambda s: s.slots_in_use),
    "ds4serve_slots_total": ("sequence slots allocated at start-up", lambda s: s.slots_total),
    "ds4serve_pages_in_use": ("cache pages in use", lambda s: s.pages_in_use),
    "ds4serve_pages_total": ("cache pages in the pool", lambda s: s.pages_total),
    "ds4serve_host_suspend_bytes": ("host memory held by suspended requests", lambda s: s.host_used),
    "ds4serve_passes_in_flight": ("prefill passes spanning several steps", lambda s: s.requests["passes"]),
    "ds4serve_decode_width": (f"mean decoding rows per decode step over the last {DECODE_WIDTH_WINDOW} decode "
                              "steps (the batch width decode really runs at)", lambda s: s.decode_width),
}
_COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {  # name (without _total): (help, figure)
    "ds4serve_engine_steps": ("engine steps executed", lambda s: s.steps),
    "ds4serve_decode_steps": ("engine steps that decoded at least one row", lambda s: s.decode_steps),
    "ds4serve_decode_rows": ("rows decoded (one token each), summed over steps", lambda s: s.decode_rows),
    "ds4serve_prefill_rows": ("prefill rows run in pass slices, summed over steps", lambda s: s.prefill_rows),
}
# the prefix cache, from ``EngineStats.prefix`` (all zero when caching is off)
_PREFIX_GAUGES = {  # name: (help, EngineStats.prefix key)
    "ds4serve_prefix_cache_enabled": ("1 when the prefix cache is on", "enabled"),
    "ds4serve_prefix_cache_bytes": ("bytes held by the prefix cache (snapshots and shared pages)", "cached_bytes"),
    "ds4serve_prefix_cache_budget_bytes": ("the prefix cache's byte budget", "budget_bytes"),
    "ds4serve_prefix_cache_snapshots": ("prefix snapshots held", "snapshots"),
    "ds4serve_prefix_cache_pages": ("cache pages held by the prefix cache", "cached_pages"),
}
_PREFIX_COUNTERS = {  # name (without _total): (help, EngineStats.prefix key)
    "ds4serve_prefix_cache_hit_tokens": ("prompt tokens whose state came from the prefix cache", "hit_tokens"),
    "ds4serve_prefix_cache_queried_tokens": ("prompt tokens looked up in the prefix cache", "queried_tokens"),
    "ds4serve_prefix_cache_hits": ("prefix-cache lookups that found a cached prefix", "hits"),
    "ds4serve_prefix_cache_misses": ("prefix-cache lookups that found nothing", "misses"),
    "ds4serve_prefix_cache_stores": ("prefix snapshots stored", "stored"),
    "ds4serve_prefix_cache_evictions": ("prefix snapshots evicted (budget or memory pressure)", "evictions"),
}
# the lower tiers (cache/tiers.py), one series per tier: name: (help, EngineStats.prefix key after "<tier>_")
_PREFIX_TIERS = ("host", "disk")
_TIER_GAUGES = {"ds4serve_prefix_cache_tier_bytes": ("bytes of prefix snapshots held on a lower tier", "bytes"),
                "ds4serve_prefix_cache_tier_snapshots": ("prefix snapshots held on a lower tier", "snapshots")}
_TIER_COUNTERS = {"ds4serve_prefix_cache_tier_hits": ("prefix hits brought back from a lower tier", "hits"),
                  "ds4serve_prefix_cache_tier_evictions": ("prefix snapshots a lower tier evicted", "evictions")}


class _EngineCollector:
    """The engine's series, rendered at scrape time from the latest ``EngineStats`` (none before a
    source is bound: a ``Metrics`` without an engine serves only its own series)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.source: Callable[[], EngineStats] | None = None

    def collect(self):
        if self.source is None:
            return
        s, m = self.source(), [self.model_name]
        for name, (doc, figure) in _GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, figure(s))
            yield g
        pre = CounterMetricFamily("ds4serve_preemptions", "requests preempted under memory pressure, by kind "
                                  "(suspend to host, drop for recompute, fail)", labels=["model_name", "kind"])
        for kind in ("suspend", "drop", "fail"):
            pre.add_metric([*m, kind], s.counters.get(f"preempt_{kind}", 0))
        yield pre
        for name, (doc, figure) in _COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, figure(s))
            yield c
        yield from self._prefix(s.prefix)
        yield from self._speculation(s.speculation)

    def _speculation(self, sp):
        """Speculative decoding, with vLLM's names (``spec_decode_num_*``) under our prefix; per draft
        position, drafted and accepted counts (their ratio is the acceptance at that position)."""
        m = [self.model_name]
        for name, doc, key in (("ds4serve_spec_decode_num_drafts", "verify steps that carried a draft", "verify_steps"),
                               ("ds4serve_spec_decode_num_draft_tokens", "drafted tokens verified", "drafted_tokens"),
                               ("ds4serve_spec_decode_num_accepted_tokens", "drafted tokens accepted",
                                "accepted_tokens")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, sp.get(key, 0))
            yield c
        for what in ("drafted", "accepted"):
            c = CounterMetricFamily(f"ds4serve_spec_decode_num_{what}_tokens_per_pos",
                                    f"drafted tokens {what} at each draft position", labels=["model_name", "position"])
            for key, n in sorted(sp.items()):
                if key.startswith(f"{what}_at_"):
                    c.add_metric([*m, key.rsplit("_", 1)[1]], n)
            yield c

    def _prefix(self, p):
        """The prefix-cache series; a key the core does not report reads 0 (a scrape never fails)."""
        m = [self.model_name]
        for name, (doc, key) in _PREFIX_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, float(p.get(key, 0)))
            yield g
        for name, (doc, key) in _PREFIX_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, p.get(key, 0))
            yield c
        for table, family in ((_TIER_GAUGES, GaugeMetricFamily), (_TIER_COUNTERS, CounterMetricFamily)):
            for name, (doc, key) in table.items():
                f = family(name, doc, labels=["model_name", "tier"])
                for tier in _PREFIX_TIERS:
                    f.add_metric([*m, tier], float(p.get(f"{tier}_{key}", 0)))
                yield f


class _Bound:
    """A labelled metric with ``model_name`` filled in: ``.labels(x)`` is ``.labels(model, x)``."""

    def __init__(self, family, model_name: str):
        self.family, self.model_name = family, model_name

    def labels(self, *values: str):
        return self.family.labels(self.model_name, *values)


class Metrics:
    def __init__(self, model_name: str = "ds4serve"):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        r, m, lab = self.registry, model_name, ["model_name"]

        def hist(name: str, doc: str):
            return Histogram(name, doc, lab, buckets=_LATENCY_BUCKETS, registry=r).labels(m)

        self.ttft = hist("ds4serve_time_to_first_token_seconds", "time from request arrival to its first token")
        self.itl = hist("ds4serve_inter_token_latency_seconds", "gap between consecutive tokens of a stream")
        self.e2e = hist("ds4serve_request_latency_seconds", "request arrival to completion")
        self.step_time = hist("ds4serve_step_seconds", "engine step duration")
        def per_key(name: str, doc: str, *extra: str) -> _Bound:
            return _Bound(Counter(name, doc + KEY_NOTE, [*lab, "key_name", *extra], registry=r), m)

        # per-request counters, by API key name: .labels(key_name, ...) ("" without keys)
        self.prompt_tokens = per_key("ds4serve_prompt_tokens", "prompt tokens admitted (after template and image "
                                     "expansion)")
        self.cached_tokens = per_key("ds4serve_prompt_cached_tokens", "prompt tokens served from the prefix cache, "
                                     "counted per engine request (each of n choices is one)")
        self.generation_tokens = per_key("ds4serve_generation_tokens", "tokens generated")
        self.requests = per_key("ds4serve_requests", "finished requests by outcome", "outcome")
        self.rejections = per_key("ds4serve_rejections", "requests refused by the engine before admission, by "
                                  "reason", "reason")
        self.error_responses = per_key("ds4serve_error_responses", "HTTP requests answered with an error status "
                                       "(4xx refusals, 5xx failures), by status", "status")
        self.cancellations = per_key("ds4serve_cancellations", "requests stopped before their end, by reason "
                                     "(client_disconnect, timeout, server_shutdown)", "reason")

    def read_engine(self, source: Callable[[], EngineStats]) -> None:
        """Render the engine's series from ``source()`` at each scrape (``lambda: loop.stats``)."""
        self._engine.source = source

    def on_step(self, elapsed: float) -> None:
        """Engine-loop thread, after each step: its wall time."""
        self.step_time.observe(elapsed)

    def render(self) -> bytes:
        return generate_latest(self.registry)
