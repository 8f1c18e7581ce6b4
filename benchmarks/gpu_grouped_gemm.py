"""The GPU grouped GEMMs against `jax.lax.ragged_dot`, at decode and prefill sizes.

One GLM-5.3-like projection per expert ([E, K, N] = [256, 6144, 2048], top-8): for each
batch, side by side, every grouped GEMM this GPU and this jax run (`catalog.Kernel.why_not`):
the Triton kernel (`triton`, while jax has Pallas's Triton backend), Mosaic GPU's for Hopper
(`mosaic_gpu`) or for Blackwell (`blackwell_bf16`), with bf16, NVFP4 and MXFP4 weights, and
`jax.lax.ragged_dot` with bf16 weights; on a Blackwell GPU (sm_100) also the `blackwell`
kernel, whose rows are 4-bit too. Prints time, experts touched, expert bytes read,
GB/s and TFLOP/s against the card's ceilings, and each kernel's error against ragged_dot.

    python benchmarks/gpu_grouped_gemm.py            # on a GPU
    python benchmarks/gpu_grouped_gemm.py --smoke    # tiny shapes, interpreted, on CPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import moejax  # noqa: F401  (before jax: it starts jax on this host's platform, quietly)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from moejax.base import targets
from pallas_kernels import catalog, gmm_blackwell
from pallas_kernels.registry import is_blackwell


def ceilings() -> tuple[str, float, float]:
    """(device kind, HBM bytes/s, dense bf16 FLOP/s) of this machine's first device, from the
    targets table (`moejax/base/targets.py`); nan where the table has no such device."""
    kind = jax.devices()[0].device_kind
    for t in targets.TARGETS.values():
        if t.device_kind.split()[:2] == kind.split()[:2]:  # "NVIDIA H200", "NVIDIA H100", ...
            return kind, t.hbm_tb_s * 1e12, t.bf16_tflops * 1e12
    return kind, float("nan"), float("nan")


def median_seconds(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings; `--smoke` replaces the shapes with tiny ones for the interpreter."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted kernel, CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.experts, args.hidden, args.inter, args.tokens, args.reps = 8, 256, 128, [1, 16], 2
    return args


def backends(smoke: bool) -> list[str]:
    """The grouped GEMMs this GPU and this jax run (`catalog.Kernel.why_not`); the smoke run's: the
    Triton kernel interpreted."""
    if smoke:
        return ["interpret_triton"]
    here = (jax.default_backend(), jax.devices()[0], "bfloat16", "nvfp4")
    return [b for b in ("triton", "mosaic_gpu", "blackwell_bf16") if not catalog.gemm(b).why_not(*here)]


def rows(args: argparse.Namespace) -> Iterator[dict]:
    """One dict per kernel and token count, as it is timed: kernel, tokens, experts touched, MB read,
    microseconds, GB/s, % of HBM, TFLOP/s, % of peak, max error against ragged_dot's bf16 product;
    a kernel that fails gives its row as kernel, tokens and `error` (one line)."""
    _, hbm, peak = ceilings()
    rng = np.random.default_rng(0)
    w = jax.random.normal(jax.random.key(0), (args.experts, args.hidden, args.inter), jnp.bfloat16) / args.hidden**0.5
    weights = {"bf16": w, "nvfp4": pk.quantize(w, "nvfp4"), "mxfp4": pk.quantize(w, "mxfp4")}
    expert_bytes = {f: pk.nbytes(q) // args.experts for f, q in weights.items()}
    # K-major weights with MMA-tiled scales, converted once as at load time.
    prepared = {f: gmm_blackwell.prepare_weights(weights[f]) for f in ("nvfp4", "mxfp4")} if is_blackwell() else {}
    gemm = jax.jit(pk.grouped_gemm, static_argnames=("backend",))
    ragged = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
    here = backends(args.smoke)
    for tokens in args.tokens:
        ids = np.stack([rng.choice(args.experts, args.topk, replace=False) for _ in range(tokens)])
        sizes = jnp.asarray(np.bincount(ids.ravel(), minlength=args.experts), jnp.int32)
        touched = int((sizes > 0).sum())
        lhs = jax.random.normal(jax.random.key(tokens), (ids.size, args.hidden), jnp.bfloat16)
        flops = 2 * ids.size * args.hidden * args.inter
        expected = ragged(lhs, w, sizes).astype(jnp.float32)
        runs = [("ragged_dot bf16", "bf16", lambda: ragged(lhs, w, sizes))]
        runs += [
            (f"{b} {f}", f, lambda b=b, f=f: gemm(lhs, weights[f], sizes, backend=b))
            for b in here
            for f in weights
            if f != "bf16" or b != "blackwell_bf16"  # its weights are 4-bit
        ]
        runs += [
            (f"blackwell {f}", f, lambda f=f: gemm(lhs, prepared[f], sizes, backend="blackwell")) for f in prepared
        ]
        for name, fmt, fn in runs:
            try:
                seconds = median_seconds(fn, reps=args.reps)
                err = float(jnp.max(jnp.abs(fn().astype(jnp.float32) - expected)))
            except Exception as e:  # device time is scarce: one kernel's failure keeps the other rows
                yield {"kernel": name, "tokens": tokens, "error": f"{type(e).__name__}: {one_line(e)}"}
                continue
            read = touched * expert_bytes[fmt]
            yield {
                "kernel": name,
                "tokens": tokens,
                "touched": touched,
                "mb_read": read / 1e6,
                "time_us": seconds * 1e6,
                "gb_s": read / seconds / 1e9,
                "pct_hbm": 100 * read / seconds / hbm,
                "tflop_s": flops / seconds / 1e12,
                "pct_peak": 100 * flops / seconds / peak,
                "err_vs_bf16": err,
            }


def one_line(e: Exception) -> str:
    """An exception's first line, cut to 160 characters (XLA's and Mosaic's run to pages)."""
    return (str(e).strip().splitlines() or [""])[0][:160]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kind, hbm, peak = ceilings()
    print(f"{kind}: ceilings {hbm / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s bf16 dense")
    print(f"[E, K, N] = [{args.experts}, {args.hidden}, {args.inter}], top-{args.topk}")
    print(
        f"{'kernel':>18} {'tokens':>6} {'touched':>7} {'MB read':>8} {'time us':>9} "
        f"{'GB/s':>7} {'% HBM':>6} {'TFLOP/s':>8} {'% peak':>6} {'err vs bf16':>11}"
    )
    for r in rows(args):
        if "error" in r:
            print(f"{r['kernel']:>18} {r['tokens']:6d} FAILED {r['error']}")
            continue
        print(
            f"{r['kernel']:>18} {r['tokens']:6d} {r['touched']:7d} {r['mb_read']:8.1f} {r['time_us']:9.1f} "
            f"{r['gb_s']:7.1f} {r['pct_hbm']:6.1f} {r['tflop_s']:8.2f} {r['pct_peak']:6.1f} {r['err_vs_bf16']:11.3f}"
        )


if __name__ == "__main__":
    main()
