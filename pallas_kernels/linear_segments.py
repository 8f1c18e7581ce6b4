"""A `fused_linear` call laid out (`segments`: its arguments checked, one error naming what is
wrong, and each weight segment's columns, tiles and epilogue), and the math of the epilogue the
Triton kernel and its XLA twin share (RMSNorm, rotate-half RoPE)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import tiling
from pallas_kernels.tiles import pow2

PRECISIONS = (None, "highest")


def block(dim: int, most: int) -> int:
    """The block of a dim: `most`, or the power of two >= 16 covering a smaller dim."""
    return min(most, max(16, pow2(dim)))


def normalize(xf: jax.Array, rstd: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """transformers' RMSNorm past its statistic (`moejax.model.layers.rms_norm`): xf [.., n] f32
    scaled by rstd in f32, rounded to the input's dtype, times the weight (in their common dtype)."""
    return w * (xf * rstd).astype(dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [.., n] RMS-normed over its last axis, statistics in f32."""
    xf = x.astype(jnp.float32)
    return normalize(xf, lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), w, x.dtype)


def rotate_half(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE of a head's halves x1, x2 [.., R/2] (f32), as `apply_rope` without interleave."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


class Segment(NamedTuple):
    """One weight segment as the kernel walks it (static)."""

    n: int  # output columns: N_i, or N_i / 2 with act
    pairs: int  # 2: the columns are read as (gate, up) pairs, else 1
    tile: int  # output columns a program writes: a head, or the column tile
    pieces: tuple[tuple[int, int], ...]  # (first column in the tile, width): a block each
    # Per piece, which weight columns it reads: None its own, or s: every other column from column s
    # of the tile (an interleaved rope's pairs, de-interleaved as they are read).
    reads: tuple[int | None, ...]
    rotated: int  # the first of the two pieces holding the rotated halves (with `rotate`)
    start: int  # its window's first column in the kernel's view of its weight (pairs with act)
    first: int  # its first program
    count: int  # its programs
    head_norm: bool
    rotate: bool
    bias: bool
    cdtype: jnp.dtype  # the product's operands
    out_dtype: jnp.dtype


def segments(
    x, weights, *, norm, biases, residual, head_dim, head_norms, rope, rotate, act, out_dtype, tn, rope_at=None,
    interleave=None, windows=None
):  # fmt: skip
    """Checks a call's arguments (one error naming what is wrong) and lays out its segments;
    tn: the column tile of segments without a head epilogue (None: the XLA twin, no tiles).
    head_dim: one for every segment with a head epilogue, or one per segment (None where it has
    none); rope_at: per segment, a rotated head's first rotated column (None: 0s); interleave: per
    segment, whether its rotated columns come as pairs (x0, x1), (x2, x3)..., de-interleaved as they
    are read (as `moejax.model.layers.apply_rope` with interleave; None: none does); windows: per
    segment, the columns [a, b) of its weight it multiplies, or None: all (two segments may read one
    weight, each its columns, with no copy of either)."""
    if x.ndim != 2:
        raise ValueError(f"fused_linear: rows must be [M, K], got shape {x.shape}")
    m, k = x.shape
    if not weights:
        raise ValueError("fused_linear: no weight segments")
    count = len(weights)
    per_segment = (("biases", biases), ("head_norms", head_norms), ("rotate", rotate), ("interleave", interleave))
    for name, per in (*per_segment, ("windows", windows)):
        if per is not None and len(per) != count:
            raise ValueError(f"fused_linear: {name} has {len(per)} entries for {count} weight segments")
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"fused_linear: a weight segment must be [K={k}, N], got shape {w.shape}")
    windows = [window or (0, w.shape[1]) for w, window in zip(weights, windows or [None] * count)]
    for w, (a, z) in zip(weights, windows):
        if not 0 <= a < z <= w.shape[1]:
            raise ValueError(
                f"fused_linear: a window must be columns [a, b) of its weight's N={w.shape[1]}, got {(a, z)}"
            )
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"fused_linear: norm must be [K={k}], got shape {norm.shape}")
    for (a, z), b in zip(windows, biases or [None] * count):
        if b is not None and b.shape != (z - a,):
            raise ValueError(f"fused_linear: a bias must be [N={z - a}], got shape {b.shape}")
    for name, per in (("head_dim", head_dim), ("rope_at", rope_at)):
        if isinstance(per, tuple) and len(per) != count:
            raise ValueError(f"fused_linear: {name} has {len(per)} entries for {count} weight segments")
    head_dims = head_dim if isinstance(head_dim, tuple) else (head_dim,) * count
    rope_at = rope_at or (0,) * count
    interleave = interleave or (False,) * count
    head_norms = head_norms or (None,) * count
    if rope is None and rotate is not None and any(rotate):
        raise ValueError("fused_linear: rotate names segments but rope (cos, sin) is not given")
    if rope is not None and (rotate is None or not any(rotate)):
        raise ValueError("fused_linear: rope (cos, sin) given but rotate names no segment")
    rotate = rotate if rope is not None else (False,) * count
    heads = [hn is not None or r for hn, r in zip(head_norms, rotate)]
    if any(head and not dh for head, dh in zip(heads, head_dims)):
        raise ValueError("fused_linear: head norms and rope need head_dim")
    half = 0
    if rope is not None:
        cos, sin = rope
        half = cos.shape[-1]
        for dh, at, rot in zip(head_dims, rope_at, rotate):
            if rot and (cos.shape != (m, half) or sin.shape != (m, half) or half < 1 or not 0 <= at <= dh - 2 * half):
                raise ValueError(
                    f"fused_linear: rope's cos and sin must be [M={m}, R/2], R columns from rope_at={at} within "
                    f"head_dim={dh}, got shapes {cos.shape} and {sin.shape}"
                )
    for dh, at, rot, pairs, hn, b in zip(head_dims, rope_at, rotate, interleave, head_norms, biases or [None] * count):
        if rot and pairs and (dh % 2 or at % 2 or hn is not None or b is not None):
            raise ValueError(
                "fused_linear: an interleaved rope's segment has even head_dim and rope_at, no head norm nor bias"
            )
    if act is not None and (count != 1 or any(heads) or (windows[0][1] - windows[0][0]) % 2):
        raise ValueError("fused_linear: act takes one gate|up segment of an even width and no head epilogue")
    h_dtype = x.dtype if norm is None else jnp.result_type(norm.dtype, x.dtype)
    segments, first = [], 0
    for w, b, hn, head, rot, head_dim, at, pairs_read, (a, z) in zip(
        weights, biases or [None] * count, head_norms, heads, rotate, head_dims, rope_at, interleave, windows
    ):
        pairs = 2 if act is not None else 1
        n = (z - a) // pairs
        if a % pairs or (pairs_read and rot and a % 2):
            raise ValueError(
                f"fused_linear: a window of gate|up pairs or an interleaved rope starts at an even column, got {a}"
            )
        reads, rotated = None, 0
        if head:
            if n % head_dim:
                raise ValueError(
                    f"fused_linear: a segment with a head epilogue has N={n}, not whole heads of {head_dim}"
                )
            if hn is not None and hn.shape != (head_dim,):
                raise ValueError(f"fused_linear: a head norm must be [head_dim={head_dim}], got shape {hn.shape}")
            tile = head_dim
            if rot:  # the columns before the rotated ones, the rotated halves, the rest
                rest = tile - at - 2 * half
                laid = [(0, at, None), (at, half, at), (at + half, half, at + 1), (at + 2 * half, rest, None)]
                laid = [p for p in laid if p[1]]
                rotated = 1 if at else 0
                reads = tuple(r if pairs_read else None for _, _, r in laid)
                pieces = tuple((off, width) for off, width, _ in laid)
            else:
                pieces = ((0, head_dim),)
        else:
            tile = n if tn is None else block(n, tn // pairs)
            pieces = ((0, tile),)
        pieces = tuple(p for p in pieces if p[1])
        reads = reads or (None,) * len(pieces)
        cdtype = tiling.compute_dtype(h_dtype, w)
        out = jnp.dtype(out_dtype or jnp.result_type(h_dtype, w.dtype))
        segment = Segment(
            n,
            pairs,
            tile,
            pieces,
            reads,
            rotated,
            a // pairs,
            first,
            -(-n // tile),
            hn is not None,
            rot,
            b is not None,
            cdtype,
            out,
        )
        segments.append(segment)
        first += segment.count
    if residual is not None and (count != 1 or residual.shape != (m, segments[0].n)):
        raise ValueError(
            f"fused_linear: a residual goes with one segment and is its output's shape [M, N], "
            f"got shape {residual.shape} for {count} segments"
        )
    return segments


def columns(w, k: int) -> int:
    """A weight segment's output columns N, for rows of K: [K, N], or in its model's shape [K, H, Dh]
    (H * Dh) or [H, Dh, N] (K = H * Dh), as the TPU kernel takes them (an array or `layered.LayerOf`)."""
    return math.prod(w.shape[1:]) if w.shape[0] == k else w.shape[-1]


def uniform_heads(name: str, head_dim) -> None:
    """Refuses per-segment head widths (a kernel whose heads share one width)."""
    if isinstance(head_dim, tuple):
        raise ValueError(f"{name}: one head_dim for every segment (per-segment widths: the Triton kernel's)")


def check_normed(normed: bool, norm) -> None:
    if normed and norm is None:
        raise ValueError("fused_linear: normed asks for the normed rows, but no norm is given")
