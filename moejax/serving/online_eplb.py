"""Online expert placement: the scheduler's live picks feed EPLB every `interval` steps over the
last `window` forward passes, and the experts move to the new placement between two steps.

The move is one jitted program per MoE run (`sharding/moves.py`, compiled at warm-up by a move
to the same placement), run on the engine thread between steps: the step before it computes
with the old placement, the step after it with the new one, and no request waits longer than
one move. The placement tables are inputs of the programs, so nothing recompiles.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import jax
import numpy as np
from prometheus_client.core import GaugeMetricFamily

from moejax.engine import compile_clock
from moejax.engine.expert_placement import balanced
from moejax.serving.step_plan import Call
from sharding import moves, slots


@dataclasses.dataclass
class Rebalance:
    step: int
    bytes_moved: int
    ms: float
    balancedness_before: float  # device rows of the window's picks, old placement
    balancedness_after: float  # the same picks, new placement


class OnlineEPLB:
    """Rebalances `scheduler.engine`'s experts from its live picks; `rebalances` is the log."""

    def __init__(self, scheduler, window: int, interval: int, log=None):
        """`log`: where each rebalance's line goes (default: stderr at the time)."""
        self.scheduler, self.engine, self.interval, self.log = scheduler, scheduler.engine, interval, log
        self.passes: collections.deque[tuple[np.ndarray, np.ndarray]] = collections.deque(maxlen=window)
        self.steps = 0
        self.rebalances: list[Rebalance] = []
        scheduler.pick_observers.append(self.observe)
        scheduler.between_steps.append(self.maybe_rebalance)
        scheduler.rebalancer = self

    def observe(self, kind: str, ids: np.ndarray, valid: np.ndarray) -> None:
        if valid.any():
            self.passes.append((ids, valid))

    def warm_up(self) -> None:
        """Compiles the move (to the placement the experts are in: nothing changes)."""
        self.move(self.engine.phy2log)

    def counts(self) -> np.ndarray:
        """float[L, E]: picks per logical expert over the window."""
        p = self.engine.placement
        total = np.zeros((self.passes[0][0].shape[0], p.num_logical))
        for ids, valid in self.passes:
            for l in range(ids.shape[0]):
                total[l] += np.bincount(ids[l][valid].ravel(), minlength=p.num_logical)
        return total

    def balancedness(self, phy2log: np.ndarray) -> float:
        p = self.engine.placement
        rows = sum(
            slots.device_rows(ids, valid, phy2log, p.num_logical, p.ep, p.home_replicas) for ids, valid in self.passes
        )
        return slots.balancedness(rows)

    def maybe_rebalance(self) -> None:
        self.steps += 1
        if self.steps % self.interval or not self.passes:
            return
        new = balanced(self.counts(), self.engine.placement)
        old = self.engine.phy2log
        before, after = self.balancedness(old), self.balancedness(new)
        if after <= before:  # EPLB balances picks; rows, which a step waits on, may not follow: keep the old
            return
        t0 = compile_clock.now()
        moved = self.scheduler._run(Call("move_experts", {"phy2log": new}))  # every process moves its shards
        ms = compile_clock.run_ms(t0, compile_clock.now())
        self.rebalances.append(Rebalance(self.steps, moved, ms, before, after))
        print(
            f"eplb: rebalance {len(self.rebalances)} at step {self.steps}: {moved / 1e6:.2f} MB moved in {ms:.1f} ms, "
            f"balancedness {before:.2f} -> {after:.2f}",
            file=self.log or sys.stderr,
            flush=True,
        )

    def move(self, new: np.ndarray) -> int:
        """The engine's experts into placement `new`; bytes that changed device."""
        params, moved = moves.arrange(
            self.engine.placement, self.engine.params, self.engine.phy2log, new, self.engine.loops
        )
        jax.block_until_ready(params)
        self.engine.params, self.engine.phy2log = params, new
        return moved

    def collect(self):
        """/metrics: the rebalances so far and the last one's bytes, time and balancedness."""
        last = self.rebalances[-1] if self.rebalances else Rebalance(0, 0, 0.0, 1.0, 1.0)
        yield GaugeMetricFamily("moejax_eplb_rebalances", "online expert rebalances so far", value=len(self.rebalances))
        for name, value, doc in (
            ("bytes_moved", last.bytes_moved, "expert bytes that changed device"),
            ("move_ms", last.ms, "milliseconds the experts' move took"),
            ("balancedness_before", last.balancedness_before, "device rows' mean / max, old placement"),
            ("balancedness_after", last.balancedness_after, "the same, new placement"),
        ):
            yield GaugeMetricFamily(f"moejax_eplb_last_{name}", f"last rebalance: {doc}", value=float(value))

    def summary(self) -> dict:
        """bench --json's "eplb": rebalances, balancedness before the first and after the last."""
        r = self.rebalances
        return {
            "rebalances": len(r),
            "balancedness_before": r[0].balancedness_before if r else None,
            "balancedness_after": r[-1].balancedness_after if r else None,
            "bytes_moved": sum(x.bytes_moved for x in r),
            "move_ms": [round(x.ms, 2) for x in r],
        }
