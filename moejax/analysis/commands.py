"""CLI verbs of the routing analysis: `calc`, `record`, `analyze` (registered by moejax.cli)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from checkpoints.hf_config import from_hf_config
from moejax import targets
from moejax.analysis import analyze as analysis
from moejax.analysis import calc, synthetic
from moejax.config import ConfigError, ModelConfig, preset
from moejax.errors import UsageError
from moejax.flags import add_model_args, prompt_ids
from moejax.plan import OUTPUT_LEN, PROMPT_LEN
from moejax.trace import load_trace, save_trace
from moejax.vocab import STORAGE_FORMATS

GB, MB = 1e9, 1e6


def device_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UsageError(f"--devices takes positive integers separated by commas, got {text!r}")
    return counts


def positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")
    return value


def model_geometry(args) -> tuple[ModelConfig, str]:
    """The model of --preset or --hf DIR, and a name for it."""
    if getattr(args, "hf", None):
        path = Path(args.hf) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} does not exist")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return from_hf_config(hf), str(args.hf)
    return preset(args.preset), args.preset


def emit_json(doc: dict) -> None:
    print(json.dumps(doc, indent=2))


# ----------------------------------------------------------------------------- calc


def calc_table(report: dict, cfg: ModelConfig, tokens: int, expert_format: str) -> str:
    eb, lb, mb, rb = (report[k] for k in ("expert_bytes", "layer_expert_bytes", "model_expert_bytes", "row_bytes"))
    lines = [
        f"expert: {report['expert_params'] / 1e6:.1f}M parameters",
        f"bytes          per expert   per layer ({cfg.num_experts} experts)   all {len(cfg.moe_layers)} MoE layers",
    ]
    lines += [f"  {f:<12} {eb[f] / MB:8.1f} MB   {lb[f] / GB:10.2f} GB   {mb[f] / GB:18.1f} GB" for f in eb]
    lines += [
        f"row: {rb['bf16']:,} B bf16, {rb['nvfp4']:,} B nvfp4",
        f"KV cache: {report['kv_cache_bytes_per_token']:,} B bf16 per request and position (a prefill/decode "
        "hand-over moves it per prompt token)",
        f"at {tokens} tokens per step; expert bytes read as {expert_format}",
        "devices  devices/row  copies sent  replicated  slice width  even touched  even balancedness  "
        "even busiest picks  expert GB read/device  two-batch GB read/device",
    ]
    for d in report["devices"]:
        width = d["slice_width"] if d["slice_width"] is not None else "does not divide"
        lines.append(
            f"{d['n']:7d}  {d['devices_per_row']:11.2f}  {d['copies_sent_per_row']:11.2f}  {d['copies_replicated']:10d}"
            f"  {str(width):>11}  {d['even_touched_fraction']:11.1%}  {d['even_balancedness']:17.2f}"
            f"  {d['even_busiest_picks']:18.1f}  {d['expert_bytes_read_per_device'] / GB:21.3f}"
            f"  {d['two_batch_expert_bytes_read_per_device'] / GB:24.3f}"
        )
    return "\n".join(lines)


def run_calc(args) -> int:
    cfg, _ = model_geometry(args)
    devices = device_counts(args.devices)
    tokens = positive("--tokens", args.tokens)
    if args.touched is not None and not 0 <= args.touched <= cfg.num_experts:
        raise UsageError(f"--touched must be between 0 and {cfg.num_experts} experts, got {args.touched}")
    report = calc.calc_report(cfg, devices, tokens, args.touched, args.expert_format)
    if args.json:
        emit_json(report)
    else:
        print(calc_table(report, cfg, tokens, args.expert_format))
    return 0


# ----------------------------------------------------------------------------- record


def trace_fields(args) -> dict:
    """`save_trace`'s arguments from the chosen source (a synthetic generator or a model run), so
    there is one path to the file."""
    steps = positive("--steps", args.steps)
    model_source = args.preset or args.hf or getattr(args, "checkpoint", None)
    if not (args.synthetic or model_source):  # a bad argument: argparse's one line and exit 2
        args.parser.error(
            "record needs a source: --synthetic NAME, or a model: --preset NAME, --hf DIR or --checkpoint CKPT"
        )
    if args.synthetic:
        if model_source:
            raise UsageError("--synthetic generates its own picks; drop --preset/--hf/--checkpoint")
        return synthetic.generate(synthetic.SPECS[args.synthetic], steps, positive("--rows", args.rows), args.seed)
    from moejax.analysis.record import model_trace
    from moejax.factory import build_engine
    from moejax.flags import config_from_args

    engine = build_engine(config_from_args(args), args.hf, args.seed, args.checkpoint)
    prompts = args.prompt_ids or [[1]]
    engine.check_prompts(prompts)
    return model_trace(engine, prompts, steps, model_source)


def run_record(args) -> int:
    trace = save_trace(args.out, **trace_fields(args))
    summary = {
        "out": args.out,
        "model": trace.model,
        "steps": trace.num_steps,
        "layers": int(trace.ids.shape[1]),
        "rows": int(trace.ids.shape[2]),
        "k": trace.k,
        "num_experts": trace.num_experts,
    }
    if args.json:
        emit_json(summary)
    else:
        print(
            f"wrote {args.out}: {summary['steps']} steps x {summary['layers']} MoE layers x {summary['rows']} rows, "
            f"top-{summary['k']} of {summary['num_experts']} experts ({trace.model})"
        )
    return 0


# ----------------------------------------------------------------------------- analyze


def analyze_text(report: dict) -> str:
    lines = [
        f"trace: {report['trace']['model']}, {report['trace']['layers']} MoE layers, "
        f"top-{report['trace']['k']} of {report['trace']['num_experts']} experts; expert bytes as "
        f"{report['geometry']['expert_format']} of {report['geometry']['preset']}"
    ]
    for name, kind in report["kinds"].items():
        ratio = kind["busiest_expert_vs_mean"]
        lines += [
            f"\n{name}: {kind['steps']} steps of {kind['rows_per_step']:.0f} rows; EPLB fitted on {kind['fit_steps']}, "
            f"scored on {kind['test_steps']} ({report['eplb']['spare_slots']} spare slots)",
            f"  experts touched per step: {kind['experts_touched']['trace']:.1%} (even router "
            f"{kind['experts_touched']['even']:.1%})",
            f"  busiest expert per step: {kind['picks_per_expert']['busiest_per_step']:.1f} picks "
            f"(mean {kind['picks_per_expert']['mean']:.1f}); over the trace {ratio['min']:.1f}x-{ratio['max']:.1f}x "
            f"the mean (median layer {ratio['median']:.1f}x)",
            "  devices  placement        balancedness  busiest picks  copies/row  GB read/device  busiest GB",
        ]
        for d in kind["devices"]:
            for placement in ("even", "contiguous", "contiguous_test", "eplb_test", "eplb_bytes_test"):
                if placement not in d:
                    continue
                s = d[placement]
                busiest = f"{s['busiest_device_expert_bytes'] / GB:10.3f}" if "busiest_device_expert_bytes" in s else ""
                lines.append(
                    f"  {d['n']:7d}  {placement:<15}  {s['balancedness']:12.3f}  {s['busiest_device_picks']:13.1f}"
                    f"  {s['copies_per_row']:10.2f}  {s['expert_bytes_read_per_device'] / GB:14.3f}  {busiest}"
                )
    return "\n".join(lines)


def run_analyze(args) -> int:
    devices = device_counts(args.devices)
    if args.eplb_slots < 0:
        raise UsageError(f"--eplb-slots must be at least 0, got {args.eplb_slots}")
    geometry, name = model_geometry(args)
    report = analysis.analyze(load_trace(args.trace), devices, geometry, name, args.expert_format, args.eplb_slots)
    if args.plots:
        try:
            from moejax.analysis import plots  # matplotlib: ~1 s of import every other verb would pay

            report["plots"] = [str(p) for p in plots.write_plots(report, args.plots)]
        except OSError as e:
            raise UsageError(f"cannot write plots into {args.plots}: {e.strerror}") from None
    if args.json:
        emit_json(report)
    else:
        print(analyze_text(report))
        for p in report.get("plots", []):
            print(f"wrote {p}")
    return 0


# ----------------------------------------------------------------------------- trace


def run_trace(args) -> int:
    from moejax.analysis import plots, step_trace
    from moejax.factory import build_engine
    from moejax.flags import DEFAULT_PROMPTS, config_from_args

    steps = positive("--steps", args.steps)
    engine = build_engine(config_from_args(args), args.hf, args.seed, args.checkpoint)
    prompts = args.prompt_ids or DEFAULT_PROMPTS
    engine.check_prompts(prompts)
    doc = step_trace.trace_engine(engine, prompts, steps, args.prefill)
    if args.plot:
        try:
            doc["plot"] = str(plots.step_trace_heatmap(doc, args.plot))
        except OSError as e:
            raise UsageError(f"cannot write {args.plot}: {e.strerror}") from None
    if args.json:
        emit_json(doc)
        return 0
    print(f"{doc['placement']} ({doc['ep']} x {doc['tp']}), {doc['requests']} requests, routing {doc['routing']}")
    print(step_trace.table(doc))
    if args.prefill:
        print("\nprefill:\n" + step_trace.table(doc["prefill"]).replace("decode step", "prefill call"))
    if args.plot:
        print(f"wrote {doc['plot']}")
    return 0


# ----------------------------------------------------------------------------- advise


def advise_text(report: dict) -> str:
    lines = [
        f"{report['steps']} decode steps of {report['rows_per_step']:.0f} rows, {report['layers']} MoE layers, "
        f"{report['devices']} devices; costs of {report['costs']}",
        "placement        ep x tp  step ms   MoE ms  experts ms  imbalance ms  exchange ms  busiest/mean routes  "
        "EPLB test (contiguous test) MoE ms",
    ]
    for r in report["placements"]:
        s = r["contiguous"]
        step = f"{s['step_ms']:7.2f}" if s["step_ms"] is not None else "      -"
        eplb_ms = f"{r['eplb_test']['moe_ms']:.2f} ({r['contiguous_test']['moe_ms']:.2f})" if "eplb_test" in r else "-"
        lines.append(
            f"{r['placement']:<16} {r['ep']:>3} x {r['tp']:<2} {step}  {s['moe_ms']:7.2f}"
            f"  {s['expert_ms']:10.2f}  {s['imbalance_ms']:12.2f}"
            f"  {s['exchange_ms']:11.2f}  {s['busiest_device_routes']:8.1f} / {s['mean_device_routes']:<8.1f}"
            f"  {eplb_ms}"
        )
    for r in report["placements"]:
        if "eplb_placed" in r:
            lines.append(
                f"{r['placement']}: experts placed by --eplb, MoE {r['eplb_placed']['moe_ms']:.2f} ms per decode "
                f"step (contiguous {r['contiguous']['moe_ms']:.2f})"
            )
    lines.append(f"fastest: {report['ranking'][0]}")
    measured = [r for r in report["placements"] if "measured" in r]
    if measured:
        lines.append("simulated / traced (moejax trace), ms per decode step")
        lines.append(
            f"{'placement':<16} {'step':^15}"
            + "".join(f"  {h:^13}" for h in ("MoE", "experts", "imbalance"))
            + "  traced routing"
        )
        for r in measured:
            s, m = r["contiguous"], r["measured"]
            step = f"{s['step_ms']:.2f}" if s["step_ms"] is not None else "-"
            lines.append(
                f"{r['placement']:<16} {step:>6} / {m['step_ms']:<6.2f}"
                + "".join(f"  {s[k]:>5.2f} / {m[k]:<5.2f}" for k in ("moe_ms", "expert_ms", "imbalance_ms"))
                + f"  {m['routing']}"
            )
    return "\n".join(lines)


def run_advise(args) -> int:
    from moejax.analysis import costs, metrics, simulate, step_trace
    from moejax.flags import config_from_args, natural_routing_only
    from moejax.loading import with_hf_model

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
        return target_advise(args, config, trace, n)
    report = costs.advise(config, trace, n, Path(args.costs) if args.costs else None, placed, spare)
    try:
        report = simulate.with_measured(report, [step_trace.load(p) for p in args.step_trace])
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        emit_json(report)
    else:
        print(advise_text(report))
    return 0


def target_advise(args, config, trace, n: int) -> int:
    """`advise --target NAME`: the layouts ranked by the target's own compiled programs (`target_costs`)."""
    from moejax import platform
    from moejax.analysis import target_costs
    from sharding import registry

    t = targets.target(args.target)
    names = (
        [registry.placement_class(name).name for name in args.placements.split(",")]
        if args.placements
        else registry.names()
    )
    report, _ = target_costs.advise(
        config,
        trace,
        t,
        list(targets.devices(t.name, n)),
        positive("--context", args.context),
        platform.prefill_chunk(config.engine.prefill_chunk, t.platform),
        names,
    )
    report = {"model": args.hf or args.preset or "tiny", **report}
    if args.json:
        emit_json(report)
    else:
        print(target_costs.table(report))
    return 0


# ----------------------------------------------------------------------------- registration


def _add_model(parser: argparse.ArgumentParser, default: str | None) -> None:
    group = parser.add_mutually_exclusive_group(required=default is None)
    group.add_argument("--preset", default=default, help="model preset" + (f" (default {default})" if default else ""))
    group.add_argument("--hf", metavar="DIR", help="Hugging Face model directory (its config.json)")


def register(subparsers) -> None:
    p = subparsers.add_parser("calc", help="closed-form bytes, copies and even-router balance on N devices")
    _add_model(p, None)
    p.add_argument("--devices", default="8,16,32", help="device counts, comma-separated (default 8,16,32)")
    p.add_argument("--tokens", type=int, default=64, help="rows per step (default 64: a 64-request decode step)")
    p.add_argument("--touched", type=float, help="experts a step touches, for bytes read (default: even router's)")
    p.add_argument(
        "--expert-format",
        choices=STORAGE_FORMATS,
        default="nvfp4",
        help="expert format for bytes read per device (default nvfp4, with scales)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_calc)

    p = subparsers.add_parser("record", help="write a router-pick trace of a model run or a synthetic workload")
    add_model_args(p)  # the model run's source, placement and --seed, --json
    p.add_argument(
        "--synthetic",
        choices=sorted(synthetic.SPECS),
        help="generate a synthetic trace with a published model's statistics instead of running a model",
    )
    p.add_argument("--prompt-ids", type=prompt_ids, action="append", help="1,2,3 (repeat: one request each)")
    p.add_argument("--out", required=True, metavar="TRACE", help="output .npz")
    p.add_argument("--steps", type=int, default=300, help="decode steps (default 300)")
    p.add_argument("--rows", type=int, default=64, help="synthetic: rows (concurrent requests) per step (default 64)")
    p.set_defaults(func=run_record, parser=p)

    p = subparsers.add_parser("analyze", help="skew, balancedness, copies and bytes of a trace; EPLB fitted on it")
    p.add_argument("trace", help="trace .npz written by `moejax record`")
    p.add_argument("--devices", default="8,16,32", help="device counts, comma-separated (default 8,16,32)")
    _add_model(p, "glm-5.3")
    p.add_argument(
        "--expert-format",
        choices=STORAGE_FORMATS,
        default="nvfp4",
        help="expert format for bytes read (default nvfp4, with scales)",
    )
    p.add_argument("--eplb-slots", type=int, default=32, help="EPLB spare slots per layer (default 32)")
    p.add_argument("--plots", metavar="DIR", help="write PNG figures into DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_analyze)

    p = subparsers.add_parser(
        "trace",
        help="per device and MoE layer: attention, dispatch, expert and combine time "
        "of decode steps, from the profiler (Decode-Anatomy's table)",
    )
    add_model_args(p)  # the model, layout, --routing, --json
    p.add_argument(
        "--prompt-ids",
        type=prompt_ids,
        action="append",
        help="1,2,3 (repeat: one request each; default compare's eight requests)",
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps traced (default 8)")
    p.add_argument("--prefill", action="store_true", help="also report the prefill call(s) before them")
    p.add_argument("--plot", metavar="PNG", help="write the devices x layers heat map of expert time")
    p.set_defaults(func=run_trace)

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
