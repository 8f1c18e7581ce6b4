"""Routing overrides (`engine.routing`, `--routing`): picks dealt on the host for every forward
pass and forced on the router in place of its own choice (`model.router.route`'s `forced`).

- natural: the router's own picks (nothing forced).
- even[:SEED]: each real row draws k distinct experts uniformly (numpy Generator, seed 0 unless given).
- round_robin: one running counter deals experts in order, k consecutive ones per row, so over
  the run's real rows every expert gets the same count (exactly, when rows * k is a multiple
  of E; within one otherwise).
- replay:TRACE: a `moejax record` trace's picks, forward pass by forward pass and layer by layer.

The combine weights stay the router's: its scores at the forced experts, normalized as the
family does (`route`). Only real rows (a request's tokens) take the mode's picks; padding rows
(batch padding, prefill positions past a prompt) are dealt round robin from a counter of their
own, so they spread their cost evenly and never shift the real rows' deal. A replayed run
therefore puts the trace's picks on the same real rows whatever its batch padding, and
recording it gives the trace back.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moejax.base.errors import UsageError
from moejax.config import ModelConfig


def valid_rows(prompt_lens: list[int], batch: int, chunk: int, start: int | None) -> np.ndarray:
    """bool[R]: which rows of one forward pass are real tokens. A prefill chunk at `start` has
    R = batch * chunk rows in (request, position) order; a decode step (start None) has R = batch."""
    lens = np.zeros(batch, np.int64)
    lens[: len(prompt_lens)] = prompt_lens  # padding requests: no real token
    if start is None:
        return lens > 0
    positions = start + np.arange(chunk)
    return (positions[None, :] < lens[:, None]).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Routing:
    mode: str = "natural"  # vocab.ROUTING_MODES
    seed: int = 0  # even's draws
    trace: object = None  # replay: a moejax.base.trace.Trace

    @classmethod
    def parse(cls, text: str, load_trace) -> Routing:
        """From a checked `engine.routing` string; `load_trace(path)` reads a replayed trace."""
        mode, _, arg = text.partition(":")
        if mode == "replay":
            return cls(mode, trace=load_trace(arg))
        return cls(mode, seed=int(arg) if arg else 0)

    def check(self, c: ModelConfig) -> None:
        """A replayed trace must come from a model with these MoE layers, experts and k."""
        t = self.trace
        if t is None:
            return
        if (t.num_experts, t.k, t.layers.tolist()) != (c.num_experts, c.num_experts_per_tok, list(c.moe_layers)):
            raise UsageError(
                f"replay: the trace has top-{t.k} of {t.num_experts} experts on MoE layers "
                f"{t.layers.tolist()}, the model top-{c.num_experts_per_tok} of {c.num_experts} on "
                f"{list(c.moe_layers)}"
            )

    def start(self, c: ModelConfig) -> Dealer | None:
        """A fresh deal for one run (None: natural, nothing forced)."""
        return None if self.mode == "natural" else Dealer(self, c)


class Dealer:
    """Forced picks for the forward passes of one run, in order: int32 [MoE layers, R, k] each."""

    def __init__(self, routing: Routing, c: ModelConfig):
        self.routing = routing
        self.layers, self.k, self.e = len(c.moe_layers), c.num_experts_per_tok, c.num_experts
        self.rng = np.random.default_rng(routing.seed)
        self.counters = {"real": 0, "padding": 0}  # round robin's next expert
        self.step = 0  # replay: the trace's next forward pass

    def picks(self, kind: str, valid: np.ndarray) -> np.ndarray:
        """int32 [L, R, k] for one forward pass ("prefill" or "decode") whose real rows are valid: bool[R]."""
        out = np.empty((self.layers, valid.size, self.k), np.int32)
        out[:, ~valid] = self._round_robin("padding", int((~valid).sum()))
        if valid.any():  # a pass of padding only (a serving warm-up) takes nothing from the deal
            out[:, valid] = self._real(kind, int(valid.sum()))
        return out

    def _real(self, kind: str, rows: int) -> np.ndarray:
        """int32 [L, rows, k]: the mode's picks for this pass's real rows."""
        if self.routing.mode == "even":  # k distinct experts per row: the first k of a random order
            return np.argsort(self.rng.random((self.layers, rows, self.e)), axis=-1)[..., : self.k]
        if self.routing.mode == "round_robin":
            return self._round_robin("real", rows)
        trace, s = self.routing.trace, self.step
        if s >= trace.num_steps:
            raise UsageError(
                f"replay: the trace has {trace.num_steps} forward passes; this run needs more "
                "(fewer --max-new-tokens or --steps)"
            )
        if trace.kind[s] != kind or trace.valid[s].sum() != rows:
            raise UsageError(
                f"replay: forward pass {s} of the trace is a {trace.kind[s]} of {trace.valid[s].sum()} "
                f"rows, this run's a {kind} of {rows}; replay with the prompts it was recorded with"
            )
        self.step += 1
        return trace.step_ids(s)

    def _round_robin(self, counter: str, rows: int) -> np.ndarray:
        """int32 [L, rows, k]: the next rows * k experts in turn, per layer (k <= E, so a row's are distinct)."""
        first = self.counters[counter]
        self.counters[counter] = first + rows * self.k
        deal = (first + np.arange(rows * self.k)) % self.e
        return np.broadcast_to(deal.reshape(rows, self.k), (self.layers, rows, self.k))
