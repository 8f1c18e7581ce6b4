"""`serve --placement auto` (and --prefill-placement / --decode-placement auto): at start, the
layouts `advise` ranks first for the model, the devices present and a trace, as the placement
flags serve then runs with (`ServeLayout`, which the caller applies); the choice and its
predicted times are logged in one line and exposed in /metrics. With --eplb-online the layouts
are ranked again on the live window every --eplb-interval steps, and a line says when another
would win by more than MARGIN (the server keeps its layout).

The ranking is `advise`'s, which the serve verb hands in (`moejax.analysis.serve_ranking`: its
`Ranking` of `Ranked` layouts; this module reads them and imports nothing of analysis). The
trace is --eplb's, else an even router: each row k distinct experts uniformly, --slots rows a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from prometheus_client.core import GaugeMetricFamily

from moejax.base.errors import UsageError
from moejax.base.trace import Trace
from moejax.launch.flags import AUTO
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
class ServeLayout:
    """The placement flags a serve runs with once "auto" is chosen."""

    devices: int
    placement: str | None
    prefill_placement: str | None = None
    decode_placement: str | None = None
    ep: int | None = None  # a hybrid layout's mesh, else the layout's own
    tp: int | None = None

    def applied(self, args: argparse.Namespace) -> argparse.Namespace:
        """`args` with these flags in place of theirs."""
        return argparse.Namespace(**{**vars(args), **dataclasses.asdict(self)})


class LayoutChoice:
    """The layouts chosen for a serve (`chosen`: phase -> Ranked), the flags that run them
    (`layout`) and how to rank the decode layouts again on other picks (`rerank(trace)` ->
    [(layout, us)], or None where it cannot)."""

    def __init__(
        self,
        target: str,
        chosen: dict,
        ranking: list[str],
        rerank,
        log=None,
        per: str = "per call",
        layout: ServeLayout | None = None,
    ):
        self.target, self.chosen, self.ranking, self.rerank, self.log = target, chosen, ranking, rerank, log
        self.per = per  # what a predicted time covers
        self.layout = layout
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


def choose(args, rank, log=None) -> LayoutChoice | None:
    """advise's choice for the "auto" placement flags in `args` (None when none is auto), its
    `layout` the flags to run it: a phase auto on its own takes its own first layout; both auto,
    advise's recommendation. rank(args, config, trace, chunk) -> Ranking: advise's layouts for
    prefill calls of `chunk` rows (`moejax.analysis.serve_ranking.rank`)."""
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
    from moejax.base.trace import load_trace
    from moejax.launch.flags import config_from_args
    from moejax.launch.loading import with_hf_model
    from moejax.serving.scheduler import SERVE_PREFILL_CHUNK

    given = argparse.Namespace(**{**vars(args), "placement": None, "prefill_placement": None, "decode_placement": None})
    config = with_hf_model(config_from_args(given), args.hf, args.checkpoint)
    trace = load_trace(config.layout.eplb) if config.layout.eplb else even_trace(config.model, args.slots)
    r = rank(args, config, trace, (config.engine.prefill_chunk or SERVE_PREFILL_CHUNK) * args.prefill_rows)
    chosen = {phase: r.recommended[phase] if len(auto) == 2 else r.ranked[phase][0] for phase in auto}
    if len(auto) == 2 and chosen["decode"].layout == chosen["prefill"].layout:
        flags = dict(placement=chosen["decode"].placement)
    else:
        flags = {
            "placement": None if args.placement == AUTO else args.placement,
            "prefill_placement": args.prefill_placement,
            "decode_placement": args.decode_placement,
            **{f"{phase}_placement": ranked.placement for phase, ranked in chosen.items()},
        }
    hybrid = next((ranked for ranked in chosen.values() if ranked.placement == Hybrid.name), None)
    layout = ServeLayout(r.devices, **flags, **(dict(ep=hybrid.ep, tp=hybrid.tp) if hybrid else {}))
    choice = LayoutChoice(r.target, chosen, [x.layout for x in r.ranked["decode"]], r.rerank, log, r.per, layout)
    print(f"moejax: {choice.line()}", file=log or sys.stderr, flush=True)
    return choice
