"""Prometheus metrics of a running server, and the router-pick trace of its live traffic.

Request latencies are observed when a request finishes (from the engine thread); gauges read
the scheduler when scraped. Expert load is the picks of the last `window` forward passes, per
MoE layer and expert, so a scrape shows the current traffic rather than all-time totals.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moejax.base.trace import save_trace
from sharding import slots

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ExpertWindow:
    """Picks per (MoE layer, expert) over the last `window` forward passes."""

    def __init__(self, layers: list[int], num_experts: int, window: int):
        self.layers, self.num_experts = layers, num_experts
        self.steps: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self.lock = threading.Lock()

    def observe(self, kind: str, ids: np.ndarray, valid: np.ndarray) -> None:
        """ids: [L, R, k], valid: [R]."""
        picked = ids[:, valid].reshape(len(self.layers), -1)  # [L, valid rows * k]
        counts = np.stack([np.bincount(row, minlength=self.num_experts) for row in picked])
        with self.lock:
            self.steps.append(counts)

    def totals(self) -> np.ndarray:
        with self.lock:
            return sum(self.steps, np.zeros((len(self.layers), self.num_experts), np.int64))

    def collect(self):
        family = GaugeMetricFamily(
            "moejax_expert_tokens",
            "rows routed to each expert over the recent window of forward passes",
            labels=["layer", "expert"],
        )
        totals = self.totals()
        for i, layer in enumerate(self.layers):
            for e in range(self.num_experts):
                family.add_metric([str(layer), str(e)], float(totals[i, e]))
        yield family


class DeviceRows:
    """Rows each expert device computed (summed over MoE layers), in total and over the last
    `window` forward passes, as the run routes them: into the engine's current expert placement."""

    def __init__(self, engine, window: int = 100):
        self.engine = engine
        self.total = np.zeros(engine.placement.ep, np.int64)
        self.steps: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self.lock = threading.Lock()

    def observe(self, kind: str, ids: np.ndarray, valid: np.ndarray) -> None:
        p = self.engine.placement
        rows = slots.device_rows(ids, valid, self.engine.phy2log, p.num_logical, p.ep, p.home_replicas)
        with self.lock:
            self.total += rows
            self.steps.append(rows)

    def recent(self) -> np.ndarray:
        with self.lock:
            return sum(self.steps, np.zeros_like(self.total))

    def collect(self):
        rows = GaugeMetricFamily(
            "moejax_device_rows",
            "rows each device's experts computed over the recent window of forward passes, summed over MoE layers",
            labels=["device"],
        )
        recent = self.recent()
        for d, n in enumerate(recent):
            rows.add_metric([str(d)], float(n))
        yield rows
        yield GaugeMetricFamily(
            "moejax_device_balancedness",
            "mean over max of moejax_device_rows (1: even)",
            value=slots.balancedness(recent),
        )


class Metrics:
    def __init__(self, scheduler, window: int = 100):
        self.registry = r = CollectorRegistry()
        Gauge("moejax_requests_running", "requests holding a decode slot", registry=r).set_function(
            lambda: scheduler.running
        )
        Gauge("moejax_requests_waiting", "requests queued for a slot", registry=r).set_function(
            lambda: scheduler.num_waiting
        )
        Gauge("moejax_kv_slots_used", "KV cache slots in use", registry=r).set_function(lambda: scheduler.running)
        Gauge("moejax_kv_slots_total", "KV cache slots", registry=r).set(scheduler.num_slots)
        kv = scheduler.kv
        Gauge("moejax_kv_cache_usage", "fraction of the KV cache's pages that requests hold", registry=r).set_function(
            lambda: kv.usage
        )
        Gauge("moejax_kv_pages_total", "pages in the KV cache's pool", registry=r).set(kv.num_pages)
        window_kv = scheduler.window_kv
        if window_kv is not None:  # sliding-window layers' own pages
            Gauge(
                "moejax_kv_window_cache_usage",
                "fraction of the sliding-window layers' pages that requests hold",
                registry=r,
            ).set_function(lambda: window_kv.usage)
            Gauge("moejax_kv_window_pages_total", "pages in the sliding-window layers' pool", registry=r).set(
                window_kv.num_pages
            )
        Gauge(
            "moejax_preemptions",
            "running requests that gave their pages to older ones, to be computed again",
            registry=r,
        ).set_function(lambda: scheduler.preemptions)
        if kv.prefix is not None:
            Gauge(
                "moejax_prefix_cache_queries", "prompt positions looked up in the prefix cache", registry=r
            ).set_function(lambda: kv.prefix.queries)
            Gauge("moejax_prefix_cache_hits", "prompt positions found in the prefix cache", registry=r).set_function(
                lambda: kv.prefix.hits
            )
        self.ttft = Histogram(
            "moejax_time_to_first_token_seconds", "arrival to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "moejax_inter_token_latency_seconds", "time between a request's tokens", registry=r, buckets=LATENCY_BUCKETS
        )
        self.e2e = Histogram(
            "moejax_e2e_request_latency_seconds", "arrival to last token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("moejax_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("moejax_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("moejax_requests_finished", "finished requests", ["finish_reason"], registry=r)
        if hasattr(scheduler, "drafts"):  # MTP
            Gauge("moejax_mtp_acceptance_rate", "accepted MTP drafts / drafts checked", registry=r).set_function(
                lambda: scheduler.accepted / max(1, scheduler.drafts)
            )
        if scheduler.apart:  # prefill and decode on their own devices
            Gauge(
                "moejax_handover_bytes", "KV cache bytes moved from the prefill to the decode devices", registry=r
            ).set_function(lambda: scheduler.handover_bytes)
        Gauge(
            "moejax_mixed_steps", "steps that decoded running requests and prefilled others", registry=r
        ).set_function(lambda: scheduler.mixed_steps)
        r.register(PrefilledTokens(scheduler))
        c = scheduler.engine.c
        self.experts = ExpertWindow(list(c.moe_layers), c.num_experts, window)
        r.register(self.experts)
        scheduler.pick_observers.append(self.experts.observe)
        self.devices = DeviceRows(scheduler.engine, window)
        r.register(self.devices)
        scheduler.pick_observers.append(self.devices.observe)
        if scheduler.rebalancer is not None:
            r.register(scheduler.rebalancer)

    def request_done(self, request) -> None:
        times = request.token_times
        if times:  # max_tokens 0 (echo): no token, no first-token time
            self.ttft.observe(times[0] - request.arrival)
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        self.e2e.observe(request.finished - request.arrival)
        self.prompt_tokens.inc(len(request.prompt))
        self.generation_tokens.inc(len(request.tokens))
        self.finished.labels(request.finish_reason).inc()


class PrefilledTokens:
    """Positions the scheduler prefilled: n samples of a prompt count it once, a prefix-cache hit
    not at all, a preempted request's recompute again."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        yield CounterMetricFamily(
            "moejax_prefill_tokens",
            "positions prefilled (n samples of a prompt: once; prefix-cache hits: none)",
            value=self.scheduler.prefilled_tokens,
        )


class TraceRecorder:
    """Every forward pass's router picks, written in `record`'s trace format by `save`."""

    def __init__(self, scheduler, model: str):
        c = scheduler.engine.c
        self.layers, self.num_experts, self.model = list(c.moe_layers), c.num_experts, model
        self.passes: list[tuple[str, np.ndarray, np.ndarray]] = []
        scheduler.pick_observers.append(self.observe)

    def observe(self, kind: str, ids: np.ndarray, valid: np.ndarray) -> None:
        if valid.any():
            self.passes.append((kind, ids, valid))

    def save(self, path) -> None:
        if not self.passes:
            return
        rows = max(ids.shape[1] for _, ids, _ in self.passes)
        l, k = self.passes[0][1].shape[0], self.passes[0][1].shape[2]
        ids = np.zeros((len(self.passes), l, rows, k), np.int32)  # [S, L, R, k]
        valid = np.zeros((len(self.passes), rows), bool)
        for s, (_, p, v) in enumerate(self.passes):
            ids[s, :, : p.shape[1]] = p
            valid[s, : p.shape[1]] = v
        save_trace(path, ids, valid, [kind for kind, _, _ in self.passes], self.layers, self.num_experts, self.model)
