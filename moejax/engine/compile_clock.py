"""Seconds jax spends making programs (tracing, lowering, compiling or loading them from the
persistent cache), so that run timings can report compile time apart from run time.

jax reports each phase as a time span; spans nest (a jit traced inside another's trace), so
the clock counts the union of the spans, not their sum.
"""

from __future__ import annotations

import time

import jax

_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_spans: list[tuple[float, float]] = []  # (start, end) in time.time() seconds
_listening = False


def _record(event: str, start: float, end: float, **_) -> None:
    if event in _EVENTS:
        _spans.append((start, end))


def start() -> None:
    """Begin recording (once per process; later calls do nothing)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_time_span_listener(_record)
        _listening = True


def now() -> float:
    """The clock spans are measured on."""
    return time.time()


def compile_seconds(since: float = 0.0, until: float = float("inf")) -> float:
    """Union of the compile spans recorded since start(), clipped to [since, until]."""
    total, reach = 0.0, since
    for s, e in sorted(_spans):
        s, e = max(s, reach), min(e, until)
        if e > s:
            total += e - s
            reach = e
    return total


def run_ms(t0: float, t1: float) -> float:
    """Wall milliseconds between two `now()`s, less the time spent compiling in between."""
    return 1e3 * (t1 - t0 - compile_seconds(t0, t1))
