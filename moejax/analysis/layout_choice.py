"""`serve --placement auto` (and --prefill-placement / --decode-placement auto): at start, the
layouts `advise` ranks first for the model, the devices present and a trace; the choice and its
predicted times are logged in one line and exposed in /metrics. With --eplb-online the layouts
are ranked again on the live window every --eplb-interval steps, and a line says when another
would win by more than MARGIN (the server keeps its layout).

The ranking is `advise`'s: on a CPU host its measured table (`advise --target cpu`: decode only,
so both phases take its first); on an accelerator host the target whose device_kind the devices
report (`moejax.targets`), priced from the layouts' programs compiled on those devices. The trace
is --eplb's, else an even router: each row k distinct experts uniformly, --slots rows a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from prometheus_client.core import GaugeMetricFamily

from moejax.errors import UsageError
from moejax.flags import AUTO
from moejax.trace import Trace
from sharding.hybrid import Hybrid

EVEN_STEPS = 32  # decode steps of the even router's trace
MARGIN = 0.1  # another layout is logged when it would take this share less time than the chosen one


def even_trace(model, rows: int, steps: int = EVEN_STEPS, seed: int = 0) -> Trace:
    """Decode steps of `rows` rows, each picking k distinct experts uniformly in every MoE layer."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((steps, len(model.moe_layers), rows, model.num_experts)), axis=-1)
    return Trace(
        ids=ids[..., : model.num_experts_per_tok].astype(np.int32),
        valid=np.ones((steps, rows), bool),
        kind=np.full(steps, "decode"),
        layers=np.array(model.moe_layers, np.int32),
        num_experts=model.num_experts,
        model="even router",
    )


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One layout as advise ranks it for a phase."""

    layout: str  # advise's label ("hybrid 2x4")
    placement: str
    ep: int
    tp: int
    us: float  # predicted per call


class LayoutChoice:
    """The layouts chosen for a serve (`chosen`: phase -> Ranked) and how to rank the decode
    layouts again on other picks (`rerank(trace)` -> [(layout, us)], or None where it cannot)."""

    def __init__(self, target: str, chosen: dict, ranking: list[str], rerank, log=None, per: str = "per call"):
        self.target, self.chosen, self.ranking, self.rerank, self.log = target, chosen, ranking, rerank, log
        self.per = per  # what a predicted time covers
        self.latest: tuple[str, float] | None = None  # the live window's first decode layout, its time

    def line(self) -> str:
        same = len(set(self.chosen.values())) == 1  # one layout, one time: said once
        picks = "; ".join(
            f"{' and '.join(self.chosen) if same else phase} {r.layout}, predicted {r.us:.1f} us {self.per}"
            for phase, r in (list(self.chosen.items())[:1] if same else self.chosen.items())
        )
        return f"layout auto ({self.target}): {picks}; advise's decode ranking: {', '.join(self.ranking)}"

    def follow(self, scheduler) -> None:
        """With online EPLB: rank again on its window every interval of steps."""
        eplb = scheduler.rebalancer
        if eplb is None or "decode" not in self.chosen:
            return
        steps = 0

        def readvise() -> None:
            nonlocal steps
            steps += 1
            if steps % eplb.interval or not eplb.passes:
                return
            ids = np.stack([i for i, _ in eplb.passes])  # [S, L, R, k]
            window = Trace(
                ids=ids,
                valid=np.stack([v for _, v in eplb.passes]),
                kind=np.full(len(ids), "decode"),
                layers=np.zeros(ids.shape[1], np.int32),
                num_experts=eplb.engine.c.num_experts,
                model="live window",
            )
            ranked = self.rerank(window)
            if not ranked:
                return
            self.latest = best = ranked[0]
            mine = self.chosen["decode"].layout
            now = dict(ranked).get(mine)
            if best[0] != mine and now and now - best[1] > MARGIN * now:
                print(
                    f"moejax: layout re-advised at step {steps} on the last {len(ids)} passes: {best[0]} would "
                    f"decode in {best[1]:.1f} us against {now:.1f} us under {mine} (the server keeps {mine})",
                    file=self.log or sys.stderr,
                    flush=True,
                )

        scheduler.between_steps.append(readvise)

    def collect(self):
        chosen = GaugeMetricFamily(
            "moejax_layout_predicted_us",
            "the layout serve --placement auto chose per phase and its predicted microseconds per call",
            labels=["phase", "layout", "target"],
        )
        for phase, r in self.chosen.items():
            chosen.add_metric([phase, r.layout, self.target], r.us)
        yield chosen
        if self.latest:
            live = GaugeMetricFamily(
                "moejax_layout_live_best_us",
                "the decode layout ranked first on the live window of picks and its predicted microseconds per step",
                labels=["layout"],
            )
            live.add_metric([self.latest[0]], self.latest[1])
            yield live


def choose(args, log=None) -> LayoutChoice | None:
    """Resolves the "auto" placement flags in `args` to advise's choice (None when none is auto):
    a phase auto on its own takes its own first layout; both auto, advise's recommendation."""
    auto = [
        phase
        for phase in ("decode", "prefill")
        if getattr(args, f"{phase}_placement") == AUTO
        or (getattr(args, f"{phase}_placement") is None and args.placement == AUTO)
    ]
    if not auto:
        return None
    if args.num_processes > 1 or args.prefill_devices or args.decode_devices or args.ep or args.tp:
        raise UsageError(
            "--placement auto chooses the layout for one process on the devices both phases share; "
            "drop --num-processes, --prefill-devices/--decode-devices and --ep/--tp, or name the placements"
        )
    from moejax import platform
    from moejax.flags import config_from_args
    from moejax.loading import with_hf_model
    from moejax.trace import load_trace

    given = argparse.Namespace(**{**vars(args), "placement": None, "prefill_placement": None, "decode_placement": None})
    config = with_hf_model(config_from_args(given), args.hf, args.checkpoint)
    trace = load_trace(config.layout.eplb) if config.layout.eplb else even_trace(config.model, args.slots)
    target, ranked, recommended, rerank, per = (_on_target if platform.attached_accelerator() else _on_cpu)(
        args, config, trace
    )
    chosen = {phase: recommended[phase] if len(auto) == 2 else ranked[phase][0] for phase in auto}
    if len(auto) == 2 and chosen["decode"].layout == chosen["prefill"].layout:
        args.placement, args.prefill_placement, args.decode_placement = chosen["decode"].placement, None, None
    else:
        for phase, r in chosen.items():
            setattr(args, f"{phase}_placement", r.placement)
        args.placement = None if args.placement == AUTO else args.placement
    hybrid = next((r for r in chosen.values() if r.placement == Hybrid.name), None)
    args.ep, args.tp = (hybrid.ep, hybrid.tp) if hybrid else (None, None)
    choice = LayoutChoice(target, chosen, [r.layout for r in ranked["decode"]], rerank, log, per)
    print(f"moejax: {choice.line()}", file=log or sys.stderr, flush=True)
    return choice


def _on_cpu(args, config, trace) -> tuple:
    """advise --target cpu with this host's cores as devices (or --devices): decode only, both
    phases take its ranking. Times: the decode step's, its MoE part until the table has the rest."""
    from moejax import platform
    from moejax.analysis import costs, simulate

    args.devices = n = args.devices or platform.host_cores()

    def ranking(report: dict) -> list[Ranked]:
        return [
            Ranked(
                r["placement"],
                r["placement"],
                r["ep"],
                r["tp"],
                1e3 * (r["contiguous"]["step_ms"] or r["contiguous"]["moe_ms"]),
            )
            for r in report["placements"]
        ]

    report = costs.measure_and_rank(config, trace, n)
    first, table = ranking(report), costs.load(costs.default_path(config), config)
    per = (
        "per decode step"
        if report["placements"][0]["contiguous"]["step_ms"]
        else "of MoE per decode step (the table has no non-MoE term)"
    )

    def rerank(window: Trace):
        try:
            return [(r.layout, r.us) for r in ranking(simulate.rank_placements(window, n, table))]
        except (KeyError, ValueError):  # row counts the table was not measured at
            return None

    return "cpu", {"decode": first, "prefill": first}, {"decode": first[0], "prefill": first[0]}, rerank, per


def _on_target(args, config, trace) -> tuple:
    """advise --target for the attached devices' kind, its layouts compiled on them."""
    import jax

    from moejax import targets
    from moejax.analysis import target_ranking
    from moejax.serving.scheduler import SERVE_PREFILL_CHUNK
    from sharding import registry

    kind = jax.devices()[0].device_kind
    t = next((t for t in targets.TARGETS.values() if t.device_kind == kind), None)
    if t is None:
        raise UsageError(f"no target in moejax.targets describes {kind!r}; name the placements")
    devices = jax.devices()[: args.devices or len(jax.devices())]
    args.devices = len(devices)
    context = args.max_seq_len or min(config.model.max_position_embeddings, 2048)
    chunk = (config.engine.prefill_chunk or SERVE_PREFILL_CHUNK) * args.prefill_rows
    report, candidates = target_ranking.rank_on_target(config, trace, t, devices, context, chunk, registry.names())
    ranked = {
        phase: [Ranked(r.layout, r.placement, r.ep, r.tp, r.us.step) for r in p.layouts]
        for phase, p in report.phases.items()
    }
    recommended = {
        phase: next(r for r in ranked[phase] if r.layout == getattr(report.recommend, phase)) for phase in ranked
    }

    def rerank(window: Trace):
        return [(r.layout, r.us.step) for r in target_ranking.ranked(candidates, "decode", window, t, config.model)]

    return t.name, ranked, recommended, rerank, "per call"
