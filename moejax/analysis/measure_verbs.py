"""The routing measurement verbs: `calc` (closed forms), `record` (a trace of router picks),
`analyze` (a trace's balance, copies and bytes) and `trace` (per-device step times from the
profiler)."""

from __future__ import annotations

from moejax.analysis import analyze as analysis
from moejax.analysis import calc, synthetic
from moejax.analysis.verb_args import add_geometry_args, device_counts, emit_json, model_geometry, positive
from moejax.base.errors import UsageError
from moejax.base.trace import load_trace, save_trace
from moejax.config import ModelConfig
from moejax.launch.flags import add_model_args, prompt_ids
from moejax.vocab import STORAGE_FORMATS

GB, MB = 1e9, 1e6


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
    from moejax.launch.factory import build_engine
    from moejax.launch.flags import config_from_args

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
    from moejax.launch.factory import build_engine
    from moejax.launch.flags import DEFAULT_PROMPTS, config_from_args

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


# ----------------------------------------------------------------------------- registration


def register(subparsers) -> None:
    p = subparsers.add_parser("calc", help="closed-form bytes, copies and even-router balance on N devices")
    add_geometry_args(p, None)
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
    add_geometry_args(p, "glm-5.3")
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
