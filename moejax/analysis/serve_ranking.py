"""advise's ranking of the layouts for `serve --placement auto` (`moejax.serving.layout_choice`,
to which the serve verb hands `rank`; it reads the `Ranking` it returns, so analysis imports nothing
of serving and serving nothing of analysis but from its verb): on a CPU host its measured table (`advise --target cpu`:
decode only, so both phases take its first); on an accelerator host the target whose device_kind
the devices report (`moejax.base.targets`), priced from the layouts' programs compiled on those devices."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from moejax.base.errors import UsageError
from moejax.base.trace import Trace


@dataclasses.dataclass(frozen=True)
class Ranked:
    """One layout as advise ranks it for a phase."""

    layout: str  # advise's label ("hybrid 2x4")
    placement: str
    ep: int
    tp: int
    us: float  # predicted per call


class Ranking(NamedTuple):
    """advise's layouts for a serve on `devices`, on `target` ("cpu": this host's measured table)."""

    target: str
    devices: int
    ranked: dict  # phase -> [Ranked], first the fastest
    recommended: dict  # phase -> Ranked: advise's choice where both phases are auto
    rerank: object  # rerank(trace) -> [(layout, us)], or None where it cannot
    per: str  # what a predicted time covers


def rank(args, config, trace: Trace, chunk: int) -> Ranking:
    """The layouts advise ranks for serve's `args`, `config` and `trace` on this host's devices,
    its prefill calls of `chunk` rows (serve's prefill chunk times --prefill-rows)."""
    from moejax.base import platform

    if platform.attached_accelerator():
        return on_target(args, config, trace, chunk)
    return on_cpu(args, config, trace)


def on_cpu(args, config, trace) -> Ranking:
    """advise --target cpu with this host's cores as devices (or --devices): decode only, both
    phases take its ranking. Times: the decode step's, its MoE part until the table has the rest."""
    from moejax.analysis import costs, simulate
    from moejax.base import platform

    n = args.devices or platform.host_cores()

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

    return Ranking(
        "cpu", n, {"decode": first, "prefill": first}, {"decode": first[0], "prefill": first[0]}, rerank, per
    )


def on_target(args, config, trace, chunk: int) -> Ranking:
    """advise --target for the attached devices' kind, its layouts compiled on them."""
    import jax

    from moejax.analysis import target_ranking
    from moejax.base import targets
    from sharding import registry

    kind = jax.devices()[0].device_kind
    t = next((t for t in targets.TARGETS.values() if t.device_kind == kind), None)
    if t is None:
        raise UsageError(f"no target in moejax.base.targets describes {kind!r}; name the placements")
    devices = jax.devices()[: args.devices or len(jax.devices())]
    context = args.max_seq_len or min(config.model.max_position_embeddings, 2048)
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

    return Ranking(t.name, len(devices), ranked, recommended, rerank, "per call")
