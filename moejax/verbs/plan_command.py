"""The `plan` verb: arguments and tables; the programs and their bytes are `moejax.compiled.plan`'s."""

from __future__ import annotations

import json

from moejax.analysis.layer_ops import ASYNC, GROUPS, layer_ops
from moejax.base import platform, targets
from moejax.base.errors import UsageError
from moejax.compiled.plan import GB, OUTPUT_LEN, PAGE_SIZE, PROMPT_LEN, plan_placement
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.launch.factory import ensure_devices
from moejax.launch.flags import kernel_name
from moejax.vocab import ATTENTION_KERNELS, ATTENTION_MODES, DTYPES, EXPERT_FORMATS, KERNELS
from sharding import names, placement_class, with_placement

DEFAULT_HBM_GB = 288.0  # a B300's


def cmd_plan(args) -> int:
    target = targets.target(args.target) if args.target else None
    if target:
        targets.devices(target.name, args.devices)  # the compiler is there and has that many
    else:
        ensure_devices(args.devices)
    hbm_gb = args.hbm_gb or (target.hbm_gb if target else DEFAULT_HBM_GB)
    model = preset(args.preset)
    if args.redundant_experts < 0:
        raise UsageError(f"--redundant-experts must not be negative, got {args.redundant_experts}")
    if min(args.page_size, args.prompt_len, args.output_len) < 1:
        raise UsageError(
            f"--page-size, --prompt-len and --output-len must be at least 1, got {args.page_size}, "
            f"{args.prompt_len} and {args.output_len}"
        )
    config = Config(
        model=model,
        layout=LayoutConfig(
            devices=args.devices,
            attention=args.attention,
            two_batch_overlap=args.two_batch_overlap,
            redundant_experts=args.redundant_experts,
        ),
        weights=WeightsConfig(args.expert_format),
        engine=EngineConfig(dtype=args.dtype),
        kernel=args.kernel,
        attention_kernel=args.attention_kernel,
    ).validate()
    # all: with --two-batch-overlap, the placements whose rows travel
    # and with spare slots, the placements that hold whole experts on some devices
    chosen = (
        [
            n
            for n in names()
            if not (args.two_batch_overlap and placement_class(n).rows_stay_home)
            and not (args.redundant_experts and placement_class(n).holds_every_expert)
        ]
        if args.placement == "all"
        else [args.placement]
    )
    if args.devices == 1:  # every placement is the single device there
        chosen = chosen[:1]
    rows = [
        plan_placement(
            with_placement(config, name, args.devices),
            args.batch,
            args.context,
            args.prefill_chunk,
            hbm_gb,
            args.page_size,
            args.prompt_len,
            args.output_len,
            args.speculative == "mtp",
            args.target,
        )
        for name in chosen
    ]
    if target:  # a layer of each placement's decode step as the target's compiler builds it
        devices = list(targets.devices(target.name, args.devices))
        for name, r in zip(chosen, rows):
            config_of = with_placement(config, name, args.devices)
            r["layer_ops"] = layer_ops(config_of, args.batch, args.context, target, devices, args.page_size)
    where = f"{args.devices} {target.name} ({target.device_kind})" if target else f"{args.devices} CPU"
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.preset,
                    "target": args.target or "cpu",
                    "devices": args.devices,
                    "batch": args.batch,
                    "context": args.context,
                    "prefill_chunk": args.prefill_chunk,
                    "hbm_gb": hbm_gb,
                    "placements": rows,
                }
            )
        )
        return 0 if all(r["compiled"] for r in rows) else 1
    print(
        f"{args.preset} on {where} devices ({args.dtype}, experts {args.expert_format}): decode batch "
        f"{args.batch} x {args.context} positions, prefill chunk {args.prefill_chunk}; GB per device of {hbm_gb:g}"
    )
    print(
        f"{'placement':<16}{'ep x tp':>8}{'kernel':>12}{'params':>9}{'experts':>9}{'KV cache':>10}{'temp':>8}"
        f"{'total':>8}{'fits':>6}{'compiled':>10}{'compile s':>11}"
    )
    for r in rows:
        gb = lambda key: f"{r[key] / GB:.1f}"
        done = f"{sum(p['compiled'] for p in r['programs'].values())}/{len(r['programs'])}"
        print(
            f"{r['name']:<16}{r['ep']:>4} x {r['tp']:<2}{r['kernel']:>12}{gb('param_bytes_per_device'):>9}"
            f"{gb('expert_bytes_per_device'):>9}{gb('kv_cache_bytes_per_device'):>10}{gb('temp_bytes_per_device'):>8}"
            f"{gb('total_bytes_per_device'):>8}{'yes' if r['fits'] else 'no':>6}{done:>10}{r['compile_s']:>11.1f}"
        )
    compiler = (
        f"{platform.resolve(target.platform).compiler}'s"
        if target
        else "XLA:CPU's (another compiler's buffers than a GPU's or TPU's: --target names one)"
    )
    print(f"temp: the largest of the decode step's, a decode block's and the prefill chunk's temporaries, {compiler}")
    for r in rows:
        if r["decode_kernels"]:
            k = r["decode_kernels"]
            kinds = ", ".join(f"{kind} {n / model.num_layers:.1f}" for kind, n in list(k["launch_kinds"].items())[:4])
            print(
                f"{r['name']} decode step, per layer (of {model.num_layers}): {k['launches_per_layer']:.1f} kernel "
                f"launches ({kinds}, ...), {k['weight_shaped_per_layer']:g} temporaries of a layer weight's shape"
            )
            bandwidth = f"us at {target.hbm_tb_s:g} TB/s"
            print(f"{'kernel':<28}{'programs':>9}{'SMs':>5}{'MB read':>9}{bandwidth:>16}{'calls':>7}")
            for f in k["kernels"]:
                short = " (fewer programs than SMs)" if f["programs"] < f["sms"] else ""
                print(
                    f"{f['kernel']:<28}{f['programs']:>9}{f['sms']:>5}{f['bytes'] / 1e6:>9.2f}{f['us']:>16.2f}"
                    f"{f['calls']:>7g}{short}"
                )
    if target:
        for r in rows:
            print_layer_ops(r["name"], r["layer_ops"], model.num_layers)
    if not target:
        print("kernel launches: counted on a --target's program (XLA:CPU's is not the one an accelerator launches)")
    for r in rows:
        for name, p in r["programs"].items():
            if not p["compiled"]:
                print(f"{r['name']} {name} does not compile: {p['error']}")
    kv = rows[0]["kv_pages"]
    print(
        f"KV pages of {args.page_size} positions in the memory left per device, and the requests of "
        f"{args.prompt_len} + {args.output_len} positions ({kv['pages_per_request']} pages) they fit "
        f"({args.attention} attention: {PAGE_HOLDERS[args.attention]})"
    )
    print(f"{'placement':<16}{'MB/page':>9}{'pages/device':>14}{'per rank':>10}{'requests':>10}")
    for r in rows:
        kv = r["kv_pages"]
        print(
            f"{r['name']:<16}{kv['page_bytes_per_device'] / 1e6:>9.2f}{kv['pages_per_device']:>14}"
            f"{kv['requests_per_rank']:>10}{kv['requests']:>10}"
        )
        if "window_pages_per_device" in kv:
            print(
                f"{'':<16}and the sliding-window layers' own pages: {kv['window_page_bytes_per_device'] / 1e6:.2f} "
                f"MB/page, {kv['window_pages_per_device']} per device ({kv['window_pages_per_request']} per request)"
            )
    for r in rows:
        buffers = r["exchange_buffer_bytes_per_device"]
        if any(buffers.values()):
            print(
                f"{r['name']}: exchange buffers per MoE layer, worst case (every row picks one device): "
                f"decode {buffers['decode'] / GB:.2f} GB, prefill chunk {buffers['prefill'] / GB:.2f} GB"
            )
    return 0 if all(r["compiled"] for r in rows) else 1


def print_layer_ops(name: str, ops: dict, layers: int) -> None:
    """A layer's ops (`layer_ops.layer_ops`) by group, then by the part of the layer and kind, and the
    step's bytes against the chip's HBM bandwidth."""
    deep, shallow = ops["depths"][1], ops["depths"][0]
    if "error" in ops:
        print(f"{name} decode step, a layer: its step of {deep} layers does not compile: {ops['error']}")
        return
    g = ops["groups"]
    counts = ", ".join(f"{k} {g[k]:g}" for k in GROUPS)
    print(
        f"{name} decode step, a layer (the step of {deep} layers less that of {shallow}): {ops['ops']:g} "
        f"synchronous ops ({counts}; {ASYNC} {g[ASYNC]:g} beside them), {ops['layer_bytes'] / 1e6:.1f} MB"
    )
    parts = {}
    for p in ops["parts"]:
        parts.setdefault(p["part"] or "(outside the layer's scopes)", []).append(f"{p['kind']} {p['ops']:g}")
    for part, kinds in parts.items():
        print(f"  {part}: {', '.join(kinds)}")
    print(
        f"  the step of {layers} layers moves {ops['step_bytes'] / GB:.2f} GB: {ops['step_us']:,.0f} us at "
        f"{ops['hbm_tb_s']:g} TB/s"
    )
    p = ops["predicted"]
    split = ", ".join(f"{c} {us:,.1f}" for c, us in p["layer_parts_us"].items())
    print(
        f"  priced on {p['target']} (estimates: every op from HBM, no overlap, no routing; "
        f"moejax/analysis/layer_ops.py): a layer {p['kernels']:g} kernels, {p['collectives']:g} collectives, "
        f"{p['layer_bytes'] / 1e6:.1f} MB, {p['layer_us']:,.1f} us ({split}); the step of {layers} layers "
        f"{p['step_ms']:.2f} ms (that of {shallow} layers {p['shallow_step_us']:,.0f} us and the layer "
        f"{layers - shallow} times more)"
    )


PAGE_HOLDERS = {
    "dp": "each device a rank with a pool of whole pages for its own requests",
    "tp": "one pool, each device its slice of every page's kv heads; MLA's latent whole on every device",
}


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-device bytes of a full-size model under each placement, compiled abstractly")
    p.add_argument("--preset", default="glm-5.3", help="a named model (full-size ones included)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--placement", default="all", choices=("all", *names()))
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, default="nvfp4")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--attention", choices=ATTENTION_MODES, default="dp")
    p.add_argument("--two-batch-overlap", action="store_true", help="the placements' exchanges as two micro-batches")
    p.add_argument(
        "--redundant-experts",
        type=int,
        default=0,
        metavar="R",
        help="spare expert slots per MoE layer for replicas (a multiple of ep); their bytes are counted",
    )
    p.add_argument("--batch", type=int, default=256, help="decode batch (concurrent requests)")
    p.add_argument("--context", type=int, default=8192, help="KV cache positions per request")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="tokens of one prefill chunk over all devices")
    p.add_argument(
        "--target",
        choices=tuple(targets.TARGETS),
        help="compile for this accelerator with its own compiler, on compile-only devices (needs the "
        "'targets' extra); default: this machine's virtual CPU devices",
    )
    p.add_argument(
        "--hbm-gb",
        type=float,
        default=0.0,
        help=f"memory per device (default: the target's, else {DEFAULT_HBM_GB:g}, a B300's)",
    )
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="positions per KV cache page")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="prompt positions of the requests the pages fit")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="new tokens of the requests the pages fit")
    p.add_argument(
        "--speculative", choices=("mtp",), help="serving with MTP drafts: the MTP layer's page pool shares the memory"
    )
    p.add_argument(
        "--kernel",
        type=kernel_name("kernel"),
        choices=KERNELS,
        default="auto",
        help="the grouped GEMM and its decode kernels (auto: by the platform it compiles for)",
    )
    p.add_argument(
        "--attention-kernel",
        type=kernel_name("attention_kernel"),
        choices=ATTENTION_KERNELS,
        default="auto",
        help="the paged attention of the decode step over pages (auto: by the platform it compiles for)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
