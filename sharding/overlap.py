"""Two-batch overlap (Row-Meets-Experts §6.5): one device's rows of a MoE layer as two micro-batches,
ordered so that each micro-batch's exchange is issued while the other one computes.

A placement that moves rows gives its exchange as three phases, run per device inside
`shard_map`: `dispatch` (rows to the experts' devices), `compute` (the local experts) and
`combine` (results back to the rows' devices). One micro-batch runs them in a row; two run

    dispatch A -> dispatch B ~ compute A -> combine A ~ compute B -> combine B

where `->` makes everything after it wait for everything before it (`_after`) and `~` joins two
pieces of work that do not wait for each other: B's dispatch has only A's compute beside it,
and A's combine only B's compute. A scheduler with asynchronous collectives (GPU, TPU) can run
each pair at once; XLA:CPU's collectives are synchronous, so on CPU this fixes the order in
which the exchanges are issued, not concurrency.

Each row meets the same experts with the same picks either way, so the outputs are the same
rows (up to the rounding of smaller GEMMs: 3e-6 of the logits on the tiny model), and the bytes
sent are the same (two halves of one exchange).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Names of the micro-batches and phases in the compiled program's op metadata (the schedule test reads them).
MICROBATCHES = ("microbatch_a", "microbatch_b")


class Phases(NamedTuple):
    """One exchange, split where its communication starts and ends (per device, in shard_map)."""

    dispatch: Callable[..., Any]  # (x: [T, D], ids: [T, k], weights: [T, k]) -> sent (a pytree)
    compute: Callable[[Any], Any]  # sent -> done: the local experts' outputs (and what combine needs)
    combine: Callable[[Any], jax.Array]  # done -> y: [T, D]


def _phase(microbatch: str, name: str, fn, *args):
    with jax.named_scope(microbatch), jax.named_scope(name):
        return fn(*args)


def one_batch(phases: Phases, x, ids, weights):
    return phases.combine(phases.compute(phases.dispatch(x, ids, weights)))


def _after(before, values):
    """`values`, made to wait for every array of `before`: a data dependency that changes
    nothing. (`lax.optimization_barrier` would say the same, but XLA:CPU removes barriers
    before it schedules, so they order nothing there.)"""
    probes = [jnp.ravel(a)[0].astype(jnp.float32) for a in jax.tree.leaves(before)]
    never = functools.reduce(jnp.logical_or, [jnp.isnan(p) & jnp.isinf(p) for p in probes])  # no number is both
    return jax.tree.map(lambda v: jnp.where(never, jnp.zeros_like(v), v), values)


def two_batch(phases: Phases, x, ids, weights):
    """x: [T, D], ids/weights: [T, k] -> [T, D]; rows [0, ceil(T/2)) are micro-batch A, the rest B.
    Fewer than two rows (a decode step of one request per device) run as one micro-batch."""
    t = x.shape[0]
    if t < 2:
        return one_batch(phases, x, ids, weights)
    half = -(-t // 2)
    mb_a, mb_b = MICROBATCHES
    sent_a = _phase(mb_a, "dispatch", phases.dispatch, x[:half], ids[:half], weights[:half])
    sent_b = _phase(mb_b, "dispatch", phases.dispatch, *_after(sent_a, (x[half:], ids[half:], weights[half:])))
    done_a = _phase(mb_a, "compute", phases.compute, sent_a)
    y_a = _phase(mb_a, "combine", phases.combine, _after(sent_b, done_a))
    done_b = _phase(mb_b, "compute", phases.compute, sent_b)
    y_b = _phase(mb_b, "combine", phases.combine, _after(y_a, done_b))
    return jnp.concatenate([y_a, y_b])


def run(phases: Phases, overlap: bool, x, ids, weights):
    return (two_batch if overlap else one_batch)(phases, x, ids, weights)
