"""Prometheus metrics: what users feel (TTFT, inter-token latency) and what the engine holds.

Engine-side figures (queue, running, suspended, parked, slots, pages, preemptions) are snapshotted
on the engine-loop thread after every step and served from that snapshot, so a scrape never
touches scheduler state from another thread. Latency histograms are observed by the request
handlers on the event loop.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    def __init__(self):
        self.snapshot: dict = {}

    def collect(self):
        s = self.snapshot
        if not s:
            return
        gauges = {
            "ds4serve_queue_depth": ("requests waiting for a slot", s["waiting"]),
            "ds4serve_requests_running": ("requests holding a slot (prefilling or decoding)", s["running"]),
            "ds4serve_requests_prefilling": ("requests prefilling", s["prefilling"]),
            "ds4serve_requests_suspended": ("requests suspended to host memory", s["suspended"]),
            "ds4serve_requests_parked": ("requests dropped, waiting to be recomputed", s["parked"]),
            "ds4serve_slots_in_use": ("sequence slots in use", s["slots_in_use"]),
            "ds4serve_slots_total": ("sequence slots allocated at start-up", s["slots_total"]),
            "ds4serve_pages_in_use": ("cache pages in use", s["pages_in_use"]),
            "ds4serve_pages_total": ("cache pages in the pool", s["pages_total"]),
            "ds4serve_host_suspend_bytes": ("host memory held by suspended requests", s["host_used"]),
            "ds4serve_passes_in_flight": ("prefill passes spanning several steps", s["passes"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        pre = CounterMetricFamily("ds4serve_preemptions", "requests preempted under memory pressure",
                                  labels=["kind"])
        for kind in ("suspend", "drop", "fail"):
            pre.add_metric([kind], s["stats"][f"preempt_{kind}"])
        yield pre
        steps = CounterMetricFamily("ds4serve_engine_steps", "engine steps executed")
        steps.add_metric([], s["steps"])
        yield steps


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self._lock = threading.Lock()
        self._steps = 0
        r = self.registry
        self.ttft = Histogram("ds4serve_time_to_first_token_seconds", "time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ds4serve_inter_token_latency_seconds", "gap between consecutive tokens of a stream",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ds4serve_request_latency_seconds", "request arrival to completion",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram("ds4serve_step_seconds", "engine step duration", buckets=_LATENCY_BUCKETS,
                                   registry=r)
        self.prompt_tokens = Counter("ds4serve_prompt_tokens", "prompt tokens admitted (after template and image "
                                     "expansion)", registry=r)
        self.generation_tokens = Counter("ds4serve_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("ds4serve_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.rejections = Counter("ds4serve_rejections", "requests refused before admission", ["reason"], registry=r)

    def on_step(self, core, outputs, elapsed: float) -> None:
        """Engine-loop thread: refresh the engine snapshot."""
        self._steps += 1
        self.step_time.observe(elapsed)
        self._engine.snapshot = snapshot(core, self._steps)

    def on_change(self, core) -> None:
        """Engine-loop thread, after commands (add/abort) changed state without a step."""
        self._engine.snapshot = snapshot(core, self._steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def snapshot(core, steps: int = 0) -> dict:
    c = core.scheduler.counts()
    cache = core.cache
    return {
        "waiting": c["waiting"], "running": c["prefilling"] + c["decoding"], "prefilling": c["prefilling"],
        "suspended": c["suspended"], "parked": c["parked"], "passes": c["passes"],
        "slots_in_use": cache.n_slots - cache.free_slots, "slots_total": cache.n_slots,
        "pages_in_use": cache.state.pages.used_pages, "pages_total": cache.state.n_pages,
        "host_used": cache.host_used, "stats": dict(core.scheduler.stats), "steps": steps, "at": time.time(),
    }
