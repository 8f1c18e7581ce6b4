"""The `advise` verb: the placements ranked for a trace's workload, by costs measured on this
machine (`--target cpu`: `costs`, `simulate`) or by a target's own compiled programs
(`target_ranking`); its tables are `advise_tables`'."""

from __future__ import annotations

from pathlib import Path

from moejax.analysis.verb_args import emit_json, positive
from moejax.base import targets
from moejax.base.errors import UsageError
from moejax.base.trace import load_trace
from moejax.compiled.plan import OUTPUT_LEN, PROMPT_LEN
from moejax.launch.flags import add_model_args


def run_advise(args) -> int:
    from moejax.analysis import advise_tables, costs, metrics, simulate, step_trace
    from moejax.launch.flags import config_from_args, natural_routing_only
    from moejax.launch.loading import with_hf_model

    n = positive("--devices", args.devices or 8)
    config = with_hf_model(config_from_args(args), args.hf)
    natural_routing_only(config, "advise (it simulates the trace's own picks)")
    trace = load_trace(args.trace)
    placed, spare = None, config.layout.redundant_experts
    if args.target != "cpu" and (config.layout.eplb or args.step_trace or args.costs):
        raise UsageError(
            "advise --target prices contiguous experts from the target's compiled programs; "
            "--eplb, --step-trace and --costs go with --target cpu"
        )
    if config.layout.eplb:
        placed = metrics.expert_counts(load_trace(config.layout.eplb)).sum(axis=0).astype(float)
        if placed.shape != (trace.ids.shape[1], trace.num_experts):
            raise UsageError(
                f"--eplb: its trace has {placed.shape[0]} MoE layers of {placed.shape[1]} experts, "
                f"{args.trace} {trace.ids.shape[1]} of {trace.num_experts}"
            )
    elif spare:
        raise UsageError("advise: --redundant-experts goes with --eplb TRACE (the placement to simulate)")
    if trace.num_experts != config.model.num_experts:
        raise UsageError(
            f"the trace has {trace.num_experts} experts but the model has {config.model.num_experts}; "
            "pass the trace's model with --preset or --hf"
        )
    if trace.num_experts % n:
        raise UsageError(f"{n} devices do not divide {trace.num_experts} experts")
    if args.target != "cpu":
        return run_advise_on_target(args, config, trace, n)
    report = costs.measure_and_rank(config, trace, n, Path(args.costs) if args.costs else None, placed, spare)
    try:
        report = simulate.with_measured(report, [step_trace.load(p) for p in args.step_trace])
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        emit_json(report)
    else:
        print(advise_tables.measured_table(report))
    return 0


def run_advise_on_target(args, config, trace, n: int) -> int:
    """`advise --target NAME`: the layouts ranked by the target's own compiled programs (`target_ranking`)."""
    from moejax.analysis import advise_tables, target_ranking
    from moejax.base import platform
    from sharding import registry

    t = targets.target(args.target)
    names = (
        [registry.placement_class(name).name for name in args.placements.split(",")]
        if args.placements
        else registry.names()
    )
    ranking, _ = target_ranking.rank_on_target(
        config,
        trace,
        t,
        list(targets.devices(t.name, n)),
        positive("--context", args.context),
        platform.prefill_chunk(config.engine.prefill_chunk, t.platform),
        names,
    )
    model = args.hf or args.preset or "tiny"
    if args.json:
        emit_json(advise_tables.target_json(model, ranking))
    else:
        print(advise_tables.target_table(model, ranking))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "advise",
        help="rank placements for a trace's workload by simulated step time, on this "
        "machine's measured costs or a target's compiled programs",
    )
    p.add_argument("trace", help="trace .npz written by `moejax record`")
    add_model_args(p)  # the model (its geometry, dtype, expert format, kernel) and --devices, --json
    p.add_argument(
        "--target",
        choices=("cpu", *targets.TARGETS),
        default="cpu",
        help="cpu: costs measured on this machine's virtual devices (decode); an accelerator: each layout's "
        "decode step and prefill chunk compiled by its own compiler and priced from the HLO",
    )
    p.add_argument(
        "--placements",
        metavar="NAMES",
        help="--target: only these placements, comma-separated (default all; hybrid at every ep x tp)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=PROMPT_LEN + OUTPUT_LEN,
        help="--target: KV positions each decode row reads (default %(default)s)",
    )
    p.add_argument(
        "--step-trace",
        metavar="JSON",
        action="append",
        default=[],
        help="a `moejax trace --json` report of the same workload (repeatable): its measured step and "
        "imbalance beside the simulated ones",
    )
    p.add_argument(
        "--costs",
        metavar="FILE",
        help="cost table JSON (default: measured on this machine, cached under ~/.cache/moejax/costs)",
    )
    p.set_defaults(func=run_advise)
