"""Decode on one accelerator against the bound its bytes set: a Qwen3-30B-A3B-shaped model.

The 48-layer Qwen3-30B-A3B shape (128 experts top-8, hidden 2,048, random weights) on one device,
expert weights bf16, NVFP4 or MXFP4, batches 1, 16 and 64: `Engine.generate` of a 128-token
prompt and 64 new tokens, its prefill and decode tokens/s, the bytes one decode step must read
(every weight but the experts, the experts an even router touches at that batch, the KV cache
the batch has written) over the copy bandwidth measured in the same run, the load's seconds,
and (`--profile`) the ten largest kernels of a device profile of one generate at the first batch.

    python benchmarks/gpu_decode.py                     # on a GPU (or TPU)
    python benchmarks/gpu_decode.py --layers 8 --profile
    python benchmarks/gpu_decode.py --smoke             # a small model on the CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import moejax  # noqa: F401  (before jax: it starts jax on this host's platform, quietly)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

from moejax.analysis import calc
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from sharding import make_placement

FORMATS = {"bf16": "unquantized", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}
# The smoke run's model: the benchmark's shape at a size the CPU runs in seconds.
SMOKE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of an elementwise pass over `nbytes` (each read once and written once)."""
    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    step = jax.jit(lambda a: a + jnp.bfloat16(1), donate_argnums=0)
    x = step(x).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x = step(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def step_bytes(config: Config, params, batch: int, context: int) -> float:
    """Bytes one decode step must read: the weights other than the experts, the experts an even
    router touches at `batch` rows in every MoE layer, and `context` positions of KV cache a row."""
    c = config.model
    fmt = config.weights.expert_format
    per_expert = calc.expert_bytes(c)["bf16" if fmt == "unquantized" else fmt]
    experts = c.num_experts * len(c.moe_layers) * per_expert
    rest = sum(a.nbytes for a in jax.tree.leaves(params)) - experts
    touched = calc.even_touched_fraction(c.num_experts, c.num_experts_per_tok, batch) * experts
    return rest + touched + batch * context * calc.kv_cache_bytes_per_token(c)


def top_kernels(engine: Engine, prompts: list[list[int]], new_tokens: int, n: int = 10) -> list[tuple]:
    """(name, total ms, count) of the `n` device ops with the most time in a profile of one generate:
    a GPU's kernels and copies by name, XLA:CPU's ops (threads of the host) by HLO op."""
    from jax.profiler import ProfileData

    from moejax.analysis.step_trace import device_of

    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out):
            engine.generate(prompts, new_tokens)
        profile = ProfileData.from_file(str(next(Path(out).rglob("*.xplane.pb"))))
    total, count = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if plane.name.startswith("/device:"):
                    name = e.name
                elif "hlo_op" in stats and device_of(plane.name, stats) is not None:
                    name = stats["hlo_op"]
                else:
                    continue
                total[name] += e.duration_ns / 1e6
                count[name] += 1
    return [(name, ms, count[name]) for name, ms in total.most_common(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings; `--smoke` replaces the model with a small one (`SMOKE`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kernel", default="auto")
    p.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="the KV cache as pages of this many positions, as a server holds it (0: contiguous rows)",
    )
    p.add_argument("--copy-mb", type=int, default=4096, help="bytes of the copy-bandwidth measure")
    p.add_argument("--profile", action="store_true", help="the ten largest kernels of one generate")
    p.add_argument("--smoke", action="store_true", help="a small model on this machine's first device (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.copy_mb = min(args.copy_mb, 64)
    return args


def model_of(args: argparse.Namespace):
    """The benchmark's model: Qwen3-30B-A3B's shape at `--layers` layers (`--smoke`: `SMOKE`'s sizes)."""
    model = dataclasses.replace(preset("qwen3-moe-30b-a3b"), num_layers=args.layers)
    return dataclasses.replace(model, **SMOKE, dense_layers=()) if args.smoke else model


def rows(args: argparse.Namespace, bandwidth: float) -> Iterator[dict]:
    """One dict per expert format and batch, as it is measured: format, batch, prefill ms and tok/s,
    decode step ms and tok/s, GB one step must read, the tok/s `bandwidth` (bytes/s) allows it, its
    percentage, the load's seconds; with `--profile`, the first batch's also `top_kernels`: (name,
    total ms, count) of one generate's ten largest kernels."""
    model = model_of(args)
    rng = np.random.default_rng(0)
    for name in args.formats:
        config = Config(
            model=model,
            layout=LayoutConfig(devices=1),
            weights=WeightsConfig(FORMATS[name]),
            engine=EngineConfig(dtype="bfloat16", page_size=args.page_size),
            kernel=args.kernel,
        ).validate()
        placement = make_placement(config)
        t0 = time.perf_counter()
        params = jax.block_until_ready(load_params(config, placement))
        load_s = time.perf_counter() - t0
        engine = Engine(config, params, placement)
        for batch in args.batches:
            prompts = rng.integers(1, model.vocab_size, (batch, args.prompt_len)).tolist()
            engine.generate(prompts, args.new_tokens)  # compiles
            run = engine.generate(prompts, args.new_tokens)
            need = step_bytes(config, engine.params, batch, args.prompt_len + args.new_tokens // 2)
            bound = batch * bandwidth / need
            tok_s = batch / (run.decode_step_ms / 1e3)
            row = {
                "experts": name,
                "batch": batch,
                "prefill_ms": run.prefill_ms,
                "prefill_tok_s": batch * args.prompt_len / (run.prefill_ms / 1e3),
                "decode_ms": run.decode_step_ms,
                "tok_s": tok_s,
                "gb_step": need / 1e9,
                "bound_tok_s": bound,
                "pct_bound": 100 * tok_s / bound,
                "load_s": load_s,
            }
            if args.profile and batch == args.batches[0]:
                row["top_kernels"] = top_kernels(engine, prompts, args.new_tokens)
            yield row
        del engine, params


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = model_of(args)
    bandwidth = copy_bandwidth(args.copy_mb << 20)
    print(
        f"{jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; {model.family} "
        f"{model.num_layers} layers, {model.num_experts} experts top-{model.num_experts_per_tok}, hidden "
        f"{model.hidden_size}; prompt {args.prompt_len}, {args.new_tokens} new tokens, kernel {args.kernel}, "
        + (f"pages of {args.page_size}" if args.page_size else "contiguous cache")
    )
    print(
        f"{'experts':>8}{'batch':>7}{'prefill ms':>12}{'prefill tok/s':>15}{'decode ms':>11}{'tok/s':>9}"
        f"{'GB/step':>9}{'bound tok/s':>13}{'% bound':>9}{'load s':>8}"
    )
    for r in rows(args, bandwidth):
        print(
            f"{r['experts']:>8}{r['batch']:>7}{r['prefill_ms']:>12.1f}{r['prefill_tok_s']:>15.0f}"
            f"{r['decode_ms']:>11.2f}{r['tok_s']:>9.0f}{r['gb_step']:>9.2f}{r['bound_tok_s']:>13.0f}"
            f"{r['pct_bound']:>9.1f}{r['load_s']:>8.1f}"
        )
        if "top_kernels" in r:
            print(f"-- the ten largest kernels of one generate, {r['experts']} batch {r['batch']}:")
            for kernel, ms, count in r["top_kernels"]:
                print(f"   {ms:9.2f} ms  x{count:<6} {kernel}")


if __name__ == "__main__":
    main()
