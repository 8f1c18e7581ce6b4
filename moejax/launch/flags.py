"""The model flags every verb that runs a model shares, and the `Config` they make.

Parsing only: `moejax.launch.factory` builds engines of the config; the verbs import both.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

from moejax.base.errors import UsageError
from moejax.config import Config, ConfigError, LayoutConfig, current_name, from_dict, load_file, replace_checked
from moejax.vocab import (
    ATTENTION_KERNELS,
    ATTENTION_MODES,
    DISPATCH_DTYPES,
    EXPERT_FORMATS,
    KERNELS,
    RUN_DTYPES,
    SPLIT_MODES,
)
from sharding import registry

AUTO = "auto"  # serve's placement flags: the layout advise ranks first (`serving/layout_choice.py`)
# Eight requests of different lengths: one per device under DP attention.
DEFAULT_PROMPTS = [[(7 * r + 3 * i) % 97 + 1 for i in range(5 + 3 * r)] for r in range(8)]


def prompt_ids(text: str) -> list[int]:
    if not text.strip():
        raise argparse.ArgumentTypeError("--prompt-ids is empty; give token ids such as 1,2,3")
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} is not a comma-separated list of integers") from None
    return ids


def placement_name(text: str) -> str:
    if text == AUTO:  # only where the flag's choices take it
        return text
    try:
        return registry.placement_class(text).name
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kernel_name(field: str):
    """The argparse type of a kernel flag of config `field`: an earlier name becomes its current one
    (`moejax.vocab.ALIASES`, noted once) before the choices are checked."""
    return functools.partial(current_name, field)


def _placements(auto: bool) -> tuple[str, ...]:
    return (*registry.names(), AUTO) if auto else tuple(registry.names())


def add_model_args(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """`auto`: --placement also takes "auto" (serve)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a named model with random weights (default: tiny)")
    src.add_argument("--hf", metavar="DIR", help="a transformers save_pretrained directory")
    src.add_argument(
        "--checkpoint", metavar="CKPT", help="a moejax checkpoint (moejax convert), restored into the placement"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON config ({model, layout, weights, engine, kernel}); flags override it",
    )
    p.add_argument(
        "--dtype",
        choices=RUN_DTYPES,
        help="auto: bfloat16 on accelerators, float32 on CPU; float32: full-precision products on every "
        "platform (not TF32 or bf16 passes); bfloat16: the platform's default products",
    )
    p.add_argument("--devices", type=int, help="number of devices (virtual CPU devices on a CPU host)")
    p.add_argument(
        "--placement",
        type=placement_name,
        choices=_placements(auto),
        help="expert placement" + (" (auto: the one advise ranks first here)" if auto else ""),
    )
    p.add_argument("--ep", type=int, help="expert groups, for a placement whose mesh the layout chooses")
    p.add_argument("--tp", type=int, help="slices of each expert, for a placement whose mesh the layout chooses")
    p.add_argument("--attention", choices=ATTENTION_MODES)
    p.add_argument(
        "--head", choices=SPLIT_MODES, help="the vocab (embedding and LM head): sliced over every device, or copied"
    )
    p.add_argument("--dispatch-dtype", choices=DISPATCH_DTYPES, help="rows as they travel to their experts")
    p.add_argument("--prefetch-depth", type=int, help="layers ahead that expert weights are gathered")
    p.add_argument(
        "--two-batch-overlap",
        action="store_true",
        default=None,
        help="placements that move rows: two micro-batches, one's exchange issued while the other computes",
    )
    p.add_argument("--expert-format", choices=EXPERT_FORMATS, help="experts in --dtype (unquantized) or 4-bit")
    p.add_argument(
        "--redundant-experts",
        type=int,
        metavar="R",
        help="spare expert slots per MoE layer for replicas of hot experts (a multiple of ep)",
    )
    p.add_argument("--eplb", metavar="TRACE", help="place the experts by EPLB on a `moejax record` trace at load")
    p.add_argument(
        "--kernel", type=kernel_name("kernel"), choices=KERNELS, help="grouped-GEMM backend (auto: by platform)"
    )
    p.add_argument(
        "--attention-kernel",
        type=kernel_name("attention_kernel"),
        choices=ATTENTION_KERNELS,
        help="how a paged KV cache's GQA attention reads its pages (auto: by platform; MLA, DSA, "
        "sinks and sliding windows read through XLA)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, help="most prompt positions per prefill call (default: 1024 on CPU, 512 elsewhere)"
    )
    p.add_argument(
        "--routing",
        metavar="MODE",
        help="picks forced on the router: natural (default), even[:SEED], "
        "round_robin, replay:TRACE (a `moejax record` trace)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--num-processes", type=int, default=1, help="multi-host: processes in the run (jax.distributed)")
    p.add_argument("--process-id", type=int, default=0, help="multi-host: this process's index")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-host: process 0's address")


def add_page_args(p: argparse.ArgumentParser) -> None:
    """The engine's KV cache as pages (generate, compare; `serve` sizes its own pool)."""
    p.add_argument(
        "--page-size",
        dest="engine_page_size",
        type=int,
        metavar="N",
        help="the KV cache as pages of N positions (0: one contiguous row per request; "
        "default: the config's engine.page_size)",
    )


def config_from_args(args, host_default: bool = False) -> Config:
    """--config FILE (its `model:` fields on top of --preset, which wins over the file's own
    preset), then the flags. `host_default` (the verbs that run one model): a run whose flags and
    file choose no layout gets this host's (`layout.devices` 0, see `host_layout`)."""
    if args.devices is not None and args.devices < 1:
        raise UsageError(
            f"--devices must be at least 1, got {args.devices} (without it, a model runs on this host's layout)"
        )
    config = load_file(args.config, preset_name=args.preset) if args.config else from_dict({}, preset_name=args.preset)
    layout = {
        k: v
        for k, v in dict(
            placement=args.placement,
            devices=args.devices,
            ep=args.ep,
            tp=args.tp,
            attention=args.attention,
            head=args.head,
            dispatch_dtype=args.dispatch_dtype,
            prefetch_depth=args.prefetch_depth,
            two_batch_overlap=args.two_batch_overlap,
            redundant_experts=args.redundant_experts,
            eplb=args.eplb,
            eplb_online=getattr(args, "eplb_online", None),
            eplb_window=getattr(args, "eplb_window", None),
            eplb_interval=getattr(args, "eplb_interval", None),
        ).items()
        if v is not None
    }
    apart = getattr(args, "prefill_placement", None) or getattr(args, "decode_placement", None)
    if host_default and not layout and config.layout == LayoutConfig() and args.num_processes == 1 and not apart:
        layout = {"devices": 0}
    engine = {
        k: v
        for k, v in dict(
            dtype=args.dtype,
            prefill_chunk=args.prefill_chunk,
            routing=getattr(args, "routing", None),
            page_size=getattr(args, "engine_page_size", None),
        ).items()
        if v is not None
    }
    config = dataclasses.replace(
        config,
        layout=replace_checked(config.layout, layout, "layout."),
        engine=replace_checked(config.engine, engine, "engine."),
        weights=replace_checked(
            config.weights, {"expert_format": args.expert_format} if args.expert_format else {}, "weights."
        ),
        kernel=args.kernel or config.kernel,
        attention_kernel=getattr(args, "attention_kernel", None) or config.attention_kernel,
    )
    return config.validate()


def natural_routing_only(config: Config, what: str) -> None:
    """Paths whose jitted steps take no forced picks refuse a routing override rather than ignore it."""
    if config.engine.routing != "natural":
        raise UsageError(f"{what} does not take --routing (only natural routing there); drop --routing")


def pd_apart(args) -> bool:
    """Prefill and decode on engines of their own: any PD flag given (a device split alone keeps
    --placement on both sides)."""
    return bool(args.prefill_placement or args.decode_placement or args.prefill_devices or args.decode_devices)


def add_pd_args(p: argparse.ArgumentParser, auto: bool = False) -> None:
    p.add_argument(
        "--prefill-placement",
        type=placement_name,
        choices=_placements(auto),
        help="prefill under this placement (default --placement), decode under --decode-placement",
    )
    p.add_argument(
        "--decode-placement",
        type=placement_name,
        choices=_placements(auto),
        help="decode under this placement (default --placement); the KV cache is handed over",
    )
    p.add_argument(
        "--prefill-devices",
        type=int,
        default=0,
        help="devices of the prefill mesh (the first ones; with --decode-devices; default: the --devices, shared)",
    )
    p.add_argument("--decode-devices", type=int, default=0, help="devices of the decode mesh (the next ones)")
