"""Row-Meets-Experts' Figures 3 and 4 (docs/references.md) on this CPU, at a scaled-down GLM geometry.

One MoE layer's routed experts (gate/up [E, H, 2I], down [E, I, H]) run through
`pallas_kernels.grouped_gemm` (XLA backend) for batches of 1 to 4,096 tokens, each picking
top-k experts. Figure 3: time against batch size, with experts touched, expert bytes read,
and effective GB/s against this machine's read bandwidth (a jitted sum over 512 MB, measured
here). Figure 4: decode steps of a fixed batch with random router skew, each replayed per
device of an expert-sharded layout (group_offset), so that picks and bytes decouple; the
correlation of time with bytes against time with picks.

    python benchmarks/grouped_gemm_cpu.py [--experts 64 --hidden 1024 --inter 256 --topk 8]
"""

from __future__ import annotations

import argparse
import time

import moejax  # noqa: F401  (before jax: it starts jax on this host's platform, quietly)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from moejax.base import platform

# The rows as XLA:CPU's engine meets them (a decode step's few gathered, more in its group loop).
ROWS = platform.resolve("cpu").gemm_rows


def timeit(fn, *args, min_time=0.3, max_reps=50) -> float:
    """Fastest seconds per call after a warm-up call (compilation). The minimum, not the
    median: on a shared 2-core machine other processes only ever add time."""
    jax.block_until_ready(fn(*args))
    times = []
    while len(times) < max_reps and sum(times) < min_time or len(times) < 5:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(mb: int = 512) -> float:
    """Bytes per second a jitted sum reads from an `mb` MB array (the roofline for decode)."""
    x = jnp.ones((mb * 1024 * 1024 // 4,), jnp.float32)
    return x.nbytes / timeit(jax.jit(jnp.sum), x, min_time=1.0)


def route(rng, tokens: int, experts: int, topk: int, skew: float) -> np.ndarray:
    """Expert ids [tokens, topk]: each token samples topk distinct experts from a popularity
    vector drawn from a Dirichlet(1 / skew) (skew -> 0: an even router; large: a few favourites)."""
    popularity = rng.dirichlet(np.full(experts, 1.0 / skew)) if skew > 0 else np.ones(experts)
    popularity = popularity / popularity.sum()
    return np.stack([rng.choice(experts, topk, replace=False, p=popularity) for _ in range(tokens)])


def make_layer(experts: int, hidden: int, inter: int, fmt: str):
    """gate_up [E, H, 2I] and down [E, I, H] in bf16 or a 4-bit format; their bytes per expert."""
    keys = jax.random.split(jax.random.key(0), 2)
    gate_up = jax.random.normal(keys[0], (experts, hidden, 2 * inter), jnp.bfloat16) / hidden**0.5
    down = jax.random.normal(keys[1], (experts, inter, hidden), jnp.bfloat16) / inter**0.5
    if fmt != "bf16":
        gate_up, down = pk.quantize(gate_up, fmt), pk.quantize(down, fmt)
    return (gate_up, down), (pk.nbytes(gate_up) + pk.nbytes(down)) // experts


@jax.jit
def experts_forward(rows, weights, group_sizes, group_offset=0):
    """rows [P, H] sorted by expert -> [P, H]: down(silu(gate) * up) per row's expert, for the
    experts [group_offset, group_offset + E_local) that `weights` hold (other rows: 0)."""
    gate_up, down = weights
    h = pk.grouped_gemm(
        rows, gate_up, group_sizes, group_offset=group_offset, preferred_element_type=jnp.float32, gemm_rows=ROWS
    )
    gate, up = jnp.split(h, 2, axis=-1)
    return pk.grouped_gemm(
        (jax.nn.silu(gate) * up).astype(rows.dtype), down, group_sizes, group_offset=group_offset, gemm_rows=ROWS
    )


@jax.jit
def dense_forward(rows, gate_up, down):
    """The same math with every row on one expert (gate_up [H, 2I], down [I, H] f32): the
    einsum rate that prefill should come near."""
    gate, up = jnp.split(rows.astype(jnp.float32) @ gate_up, 2, axis=-1)
    return ((jax.nn.silu(gate) * up) @ down).astype(rows.dtype)


def step_inputs(rng, ids: np.ndarray, hidden: int, experts: int):
    """rows [T * k, H] bf16 (sorted by expert, as the dispatch leaves them), sizes [E]."""
    sizes = np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)
    return jnp.asarray(rng.standard_normal((ids.size, hidden)), jnp.bfloat16), sizes


def figure3(args, bandwidth: float) -> None:
    rng = np.random.default_rng(0)
    print(
        f"\nFigure 3: one MoE layer, {args.experts} experts top-{args.topk}, hidden "
        f"{args.hidden}, expert intermediate {args.inter}; router skew {args.skew}"
    )
    print(
        f"{'format':>6} {'tokens':>6} {'picks':>6} {'touched':>7} {'MB read':>8} {'time ms':>8} "
        f"{'GB/s':>6} {'% bw':>5} {'GFLOP/s':>8} {'einsum GFLOP/s':>14}"
    )
    for fmt in args.formats:
        layer, expert_bytes = make_layer(args.experts, args.hidden, args.inter, fmt)
        first = jax.tree.map(lambda a: a[0], layer)  # expert 0: [H, 2I], [I, H]
        dense = [pk.dequantize(w) if isinstance(w, pk.QuantizedArray) else w.astype(jnp.float32) for w in first]
        for tokens in args.batches:
            ids = route(rng, tokens, args.experts, args.topk, args.skew)
            rows, sizes = step_inputs(rng, ids, args.hidden, args.experts)
            seconds = timeit(experts_forward, rows, layer, jnp.asarray(sizes))
            touched = int((sizes > 0).sum())
            read = touched * expert_bytes
            flops = 2 * ids.size * 3 * args.hidden * args.inter
            einsum = timeit(dense_forward, rows, *dense)
            print(
                f"{fmt:>6} {tokens:6d} {ids.size:6d} {touched:7d} {read / 1e6:8.2f} "
                f"{seconds * 1e3:8.2f} {read / seconds / 1e9:6.2f} "
                f"{100 * read / seconds / bandwidth:5.0f} {flops / seconds / 1e9:8.1f} "
                f"{flops / einsum / 1e9:14.1f}"
            )


def figure4(args) -> None:
    """As Row-Meets-Experts' Figure 4: each step replayed once per device of an expert-sharded layout (device d
    holds experts [d * E / D, (d + 1) * E / D) and gets every row that picked one of them), so
    picks and touched experts vary between points independently."""
    rng = np.random.default_rng(1)
    local = args.experts // args.devices
    print(
        f"\nFigure 4: {args.steps} decode steps of {args.decode_tokens} tokens, random router "
        f"skew, each replayed on {args.devices} devices holding {local} experts; bf16"
    )
    layer, expert_bytes = make_layer(args.experts, args.hidden, args.inter, "bf16")
    points = []
    for _ in range(args.steps):
        skew = float(np.exp(rng.uniform(-2, 3)))
        rows, sizes = step_inputs(
            rng, route(rng, args.decode_tokens, args.experts, args.topk, skew), args.hidden, args.experts
        )
        ends = np.cumsum(sizes)
        for d in range(args.devices):
            mine = sizes[d * local : (d + 1) * local]
            # The device's rows only (a dispatch delivers them), padded to a power of two so that
            # few shapes compile; the padding rows belong to no group.
            first, picks = int(ends[d * local] - sizes[d * local]), int(mine.sum())
            bucket = max(8, 1 << max(picks - 1, 0).bit_length())
            x = jnp.zeros((bucket, args.hidden), rows.dtype).at[:picks].set(rows[first : first + picks])
            shard = jax.tree.map(lambda a: a[d * local : (d + 1) * local], layer)
            seconds = timeit(experts_forward, x, shard, jnp.asarray(mine))
            points.append((seconds, int((mine > 0).sum()) * expert_bytes, picks))
    t, read, picks = (np.array(c, np.float64) for c in zip(*points))
    slope, intercept = np.polyfit(read / 1e9, t * 1e6, 1)
    print(f"{len(points)} points: time = {intercept:.0f} us + {slope:.0f} us per GB read")
    print(
        f"corr(time, bytes) = {np.corrcoef(t, read)[0, 1]:.3f}   corr(time, picks) = {np.corrcoef(t, picks)[0, 1]:.3f}"
    )
    # Both terms at once: a CPU does ~10 FLOP per byte it reads, so rows are not free here.
    design = np.stack([np.ones_like(t), read / 1e6, picks], axis=1)
    coef, *_ = np.linalg.lstsq(design, t * 1e6, rcond=None)
    fit = design @ coef
    r2 = 1 - ((t * 1e6 - fit) ** 2).sum() / ((t * 1e6 - (t * 1e6).mean()) ** 2).sum()
    print(f"time = {coef[0]:.0f} us + {coef[1]:.0f} us per MB + {coef[2]:.0f} us per pick (R^2 {r2:.3f})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--skew", type=float, default=1.0, help="Dirichlet skew of Figure 3's router")
    p.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096])
    p.add_argument("--steps", type=int, default=12, help="Figure 4 decode steps")
    # 16 tokens x top-8 over 64 experts = 2 picks per expert, Row-Meets-Experts's 64-request step.
    p.add_argument("--decode-tokens", type=int, default=16, help="Figure 4 tokens per step")
    p.add_argument("--devices", type=int, default=8, help="Figure 4 expert-sharded devices")
    p.add_argument("--read-mb", type=int, default=512, help="size of the bandwidth reading's array")
    args = p.parse_args(argv)
    # Other processes share this machine: take the best of several bandwidth readings.
    bandwidth = max(read_bandwidth(args.read_mb) for _ in range(3))
    print(
        f"{jax.default_backend()} x{jax.device_count()}: measured read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (jitted sum over {args.read_mb} MB, best of 3)"
    )
    figure3(args, bandwidth)
    figure4(args)
    print(f"read bandwidth after the runs: {read_bandwidth(args.read_mb) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
