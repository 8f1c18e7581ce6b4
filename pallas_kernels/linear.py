"""A decode step's dense products as one Triton kernel each (Pallas), and their XLA twin.

At a decode step's few rows XLA:GPU multiplies a projection as an elementwise product of the
weight's own shape and a reduce: a weight-sized temporary written and read back, and a launch for
every norm, bias, head norm and rotation around it. `fused_linear` is one launch that reads each
weight once: rows x [M, K] (optionally RMS-normed first) times weight segments W_i [K, N_i], each
column tile of a segment one program over all of K, its epilogue in registers: the bias, then a
per-head RMSNorm and rotate-half RoPE (attention's q and k), or the gated activation of a gate|up
product (writing [M, N_i / 2]), or a residual added. `fused_linear_xla` computes the same with XLA
ops, one product per segment; the tests hold both to the model's own functions.

Triton's blocks are powers of two and a dot's dims at least 16: rows, K and columns are read in
such blocks, masked past the arrays' ends (nothing beyond them is read, nothing written). A
segment with a head epilogue has a head per program, read as pieces of power-of-two blocks: the
rotated halves [0, R/2) and [R/2, R), then the columns past R.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import epilogue, metadata, tiling

PRECISIONS = (None, "highest")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's blocks and launch shape (blocks and warps powers of two, blocks at least 16). A dim
    smaller than its block takes the smallest power of two of at least 16 that covers it."""

    n: int = 64  # output columns a program writes (a gate|up segment reads twice as many)
    k: int = 64  # K rows of a step of the loop over K
    m: int = 64  # rows a program holds; more rows are a second grid axis
    num_warps: int = 4
    num_stages: int = 2


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block(dim: int, most: int) -> int:
    """The block of a dim: `most`, or the power of two >= 16 covering a smaller dim."""
    return min(most, max(16, _pow2(dim)))


def _iota(size: int, axis: int, start=0):
    """start + [0, size) along `axis` of a 2-D [size, 1] or [1, size] block (int32)."""
    return start + lax.broadcasted_iota(jnp.int32, (size, 1) if axis == 0 else (1, size), axis)


def _load(ref, *masks):
    """ref's block, zeros where any of `masks` (None: nothing masked) is False."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return ref[...]
    return pl_triton.load(ref, mask=functools.reduce(jnp.logical_and, masks), other=0)


def _normalize(xf: jax.Array, rstd: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """transformers' RMSNorm past its statistic (`moejax.model.layers.rms_norm`): xf [.., n] f32
    scaled by rstd in f32, rounded to the input's dtype, times the weight (in their common dtype)."""
    return w * (xf * rstd).astype(dtype)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [.., n] RMS-normed over its last axis, statistics in f32."""
    xf = x.astype(jnp.float32)
    return _normalize(xf, lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), w, x.dtype)


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE of a head's halves x1, x2 [.., R/2] (f32), as `apply_rope` without interleave."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


class _Segment(NamedTuple):
    """One weight segment as the kernel walks it (static)."""

    n: int  # output columns: N_i, or N_i / 2 with act
    pairs: int  # 2: the columns are read as (gate, up) pairs, else 1
    tile: int  # output columns a program writes: a head, or the column tile
    pieces: tuple[tuple[int, int], ...]  # (first column in the tile, width): a block each
    first: int  # its first program
    count: int  # its programs
    head_norm: bool
    rotate: bool
    bias: bool
    cdtype: jnp.dtype  # the product's operands
    out_dtype: jnp.dtype


def _segments(x, weights, *, norm, biases, residual, head_dim, head_norms, rope, rotate, act, out_dtype, tn):
    """Checks a call's arguments (one error naming what is wrong) and lays out its segments;
    tn: the column tile of segments without a head epilogue (None: the XLA twin, no tiles)."""
    if x.ndim != 2:
        raise ValueError(f"fused_linear: rows must be [M, K], got shape {x.shape}")
    m, k = x.shape
    if not weights:
        raise ValueError("fused_linear: no weight segments")
    count = len(weights)
    for name, per in (("biases", biases), ("head_norms", head_norms), ("rotate", rotate)):
        if per is not None and len(per) != count:
            raise ValueError(f"fused_linear: {name} has {len(per)} entries for {count} weight segments")
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"fused_linear: a weight segment must be [K={k}, N], got shape {w.shape}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"fused_linear: norm must be [K={k}], got shape {norm.shape}")
    for w, b in zip(weights, biases or [None] * count):
        if b is not None and b.shape != w.shape[1:]:
            raise ValueError(f"fused_linear: a bias must be [N={w.shape[1]}], got shape {b.shape}")
    head_norms = head_norms or (None,) * count
    if rope is None and rotate is not None and any(rotate):
        raise ValueError("fused_linear: rotate names segments but rope (cos, sin) is not given")
    if rope is not None and (rotate is None or not any(rotate)):
        raise ValueError("fused_linear: rope (cos, sin) given but rotate names no segment")
    rotate = rotate if rope is not None else (False,) * count
    heads = [hn is not None or r for hn, r in zip(head_norms, rotate)]
    if any(heads) and not head_dim:
        raise ValueError("fused_linear: head norms and rope need head_dim")
    half = 0
    if rope is not None:
        cos, sin = rope
        half = cos.shape[-1]
        if cos.shape != (m, half) or sin.shape != (m, half) or not 0 < 2 * half <= head_dim:
            raise ValueError(
                f"fused_linear: rope's cos and sin must be [M={m}, R/2] with 0 < R <= head_dim={head_dim}, "
                f"got shapes {cos.shape} and {sin.shape}"
            )
    if act is not None and (count != 1 or any(heads) or weights[0].shape[1] % 2):
        raise ValueError("fused_linear: act takes one gate|up segment of an even width and no head epilogue")
    h_dtype = x.dtype if norm is None else jnp.result_type(norm.dtype, x.dtype)
    segments, first = [], 0
    for w, b, hn, head, rot in zip(weights, biases or [None] * count, head_norms, heads, rotate):
        pairs = 2 if act is not None else 1
        n = w.shape[1] // pairs
        if head:
            if n % head_dim:
                raise ValueError(
                    f"fused_linear: a segment with a head epilogue has N={n}, not whole heads of {head_dim}"
                )
            if hn is not None and hn.shape != (head_dim,):
                raise ValueError(f"fused_linear: a head norm must be [head_dim={head_dim}], got shape {hn.shape}")
            tile = head_dim
            pieces = ((0, half), (half, half), (2 * half, head_dim - 2 * half)) if rot else ((0, head_dim),)
        else:
            tile = n if tn is None else _block(n, tn // pairs)
            pieces = ((0, tile),)
        pieces = tuple(p for p in pieces if p[1])
        cdtype = tiling.compute_dtype(h_dtype, w)
        out = jnp.dtype(out_dtype or jnp.result_type(h_dtype, w.dtype))
        segment = _Segment(
            n, pairs, tile, pieces, first, -(-n // tile), hn is not None, rot, b is not None, cdtype, out
        )
        segments.append(segment)
        first += segment.count
    if residual is not None and (count != 1 or residual.shape != (m, segments[0].n)):
        raise ValueError(
            f"fused_linear: a residual goes with one segment and is its output's shape [M, N], "
            f"got shape {residual.shape} for {count} segments"
        )
    return segments


def _check_normed(normed: bool, norm) -> None:
    if normed and norm is None:
        raise ValueError("fused_linear: normed asks for the normed rows, but no norm is given")


def _check_options(tiles: Tiles, precision):
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    for name in ("n", "k", "m", "num_warps"):
        v = getattr(tiles, name)
        if v < 1 or v & (v - 1) or (name != "num_warps" and v < 16):
            raise ValueError(f"fused_linear: tiles.{name} must be a power of two (blocks at least 16), got {v}")
    if tiles.num_stages < 1:
        raise ValueError(f"fused_linear: tiles.num_stages must be at least 1, got {tiles.num_stages}")


def _linear_kernel(*refs, tree, n_in, segments, m, k, tm, tk, eps, precision, act, normed):
    """Program (p, r): row tile r of the output tile of whichever segment program p falls in.
    Refs are whole arrays: x [M, K], norm [1, K], per segment its weight [K, N/p, p] (p: pairs),
    bias [1, N/p, p] and head norm [1, Dh]; cos, sin [M, R/2]; residual [M, N]; then the outputs:
    (`normed`: the normed rows [M, K], written by the programs p = 0) [M, N/p], one per segment."""
    ins, outs = jax.tree.unflatten(tree, refs[:n_in]), refs[n_in:]
    p, r = pl.program_id(0), pl.program_id(1)  # read outside pl.when: interpret mode wants it
    rows = pl.ds(r * tm, tm)
    in_m = None if m % tm == 0 else _iota(tm, 0, r * tm) < m  # [tm, 1]
    steps = pl.cdiv(k, tk)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    def in_k(k0, axis):  # [tk, 1] or [1, tk]: which of a step's K rows lie in K
        return None if k % tk == 0 else _iota(tk, axis, k0) < k

    def x_block(k0):  # [tm, tk]: the rows' K step
        return _load(ins["x"].at[rows, pl.ds(k0, tk)], in_m, in_k(k0, 1))

    rstd = None
    if ins["norm"] is not None:  # the rows' statistic: a first pass over x's K

        def square(k_i, acc):
            xf = x_block(k_i * tk).astype(jnp.float32)
            return acc + xf * xf

        sumsq = lax.fori_loop(0, steps, square, jnp.zeros((tm, tk), jnp.float32))
        rstd = lax.rsqrt(jnp.sum(sumsq, axis=1, keepdims=True) / k + eps)  # [tm, 1]

    def h_block(k0):  # [tm, tk]: the rows' K step as the product reads them (normed in x's dtype)
        x = x_block(k0)
        if rstd is None:
            return x
        return _normalize(x.astype(jnp.float32), rstd, _load(ins["norm"].at[:, pl.ds(k0, tk)], in_k(k0, 1)), x.dtype)

    if normed:  # the normed rows for the products after this one (the router's rows: the experts')
        normed_ref, outs = outs[0], outs[1:]

        @pl.when(p == 0)
        def _():
            def write(k_i, carry):
                k0 = k_i * tk
                mask = [mk for mk in (in_m, in_k(k0, 1)) if mk is not None]
                pl_triton.store(
                    normed_ref.at[rows, pl.ds(k0, tk)],
                    h_block(k0),
                    mask=functools.reduce(jnp.logical_and, mask) if mask else None,
                )
                return carry

            lax.fori_loop(0, steps, write, 0)

    def tile(seg: _Segment, refs, out_ref, t):  # segment seg's output tile t: [tm, seg.tile]
        c0 = t * seg.tile
        # Each piece: its first output column, its block's width, and which of its columns are real.
        pieces = []
        for off, width in seg.pieces:
            block = max(16, _pow2(width))
            cols = _iota(block, 1)
            keep = [cols < width] if block > width else []
            if seg.n % seg.tile:
                keep.append(cols + c0 + off < seg.n)
            pieces.append((c0 + off, block, functools.reduce(jnp.logical_and, keep) if keep else None))
        # The column sets (all columns, or gate and up) as array indices: interpret mode's masked
        # loads take no Python int.
        sets = [jnp.int32(i) for i in range(seg.pairs)]

        def step(k_i, accs):  # accs: per piece, per column set, [tm, block] f32
            k0 = k_i * tk
            h = h_block(k0).astype(seg.cdtype)
            return tuple(
                tuple(
                    acc
                    + dot(h, _load(refs["w"].at[pl.ds(k0, tk), pl.ds(c, b), i], in_k(k0, 0), keep).astype(seg.cdtype))
                    for i, acc in zip(sets, piece_accs)
                )
                for (c, b, keep), piece_accs in zip(pieces, accs)
            )

        zeros = tuple(tuple(jnp.zeros((tm, b), jnp.float32) for _ in sets) for _, b, _ in pieces)
        accs = lax.fori_loop(0, steps, step, zeros)
        ys = [
            [
                epilogue.finish(
                    acc, seg.out_dtype, bias=_load(refs["bias"].at[:, pl.ds(c, b), i], keep) if seg.bias else None
                )
                for i, acc in zip(sets, piece_accs)
            ]
            for (c, b, keep), piece_accs in zip(pieces, accs)
        ]
        if act is None:
            ys = [y for (y,) in ys]
        else:  # Triton has no bf16 division (the sigmoid's): the activation's math is f32
            ys = [epilogue.glu(*(y.astype(jnp.float32) for y in pair), act).astype(seg.out_dtype) for pair in ys]
        if seg.head_norm:  # the head's statistic over its pieces (masked columns are zeros)
            yf = [y.astype(jnp.float32) for y in ys]
            head_rstd = lax.rsqrt(sum(jnp.sum(f * f, axis=1, keepdims=True) for f in yf) / seg.tile + eps)
            # A piece's head norm columns from its first column's place in the head (traced: a
            # static start is checked against the ref's width, which a masked block passes).
            ys = [
                _normalize(f, head_rstd, _load(refs["head_norm"].at[:, pl.ds(c % seg.tile, b)], keep), y.dtype)
                for f, y, (c, b, keep) in zip(yf, ys, pieces)
            ]
        if seg.rotate:  # pieces 0 and 1: the rotated halves
            _, b, keep = pieces[0]
            cos, sin = (_load(a.at[rows, pl.ds(0, b)], in_m, keep) for a in ins["rope"])
            ys[:2] = (y.astype(seg.out_dtype) for y in _rotate(*(y.astype(jnp.float32) for y in ys[:2]), cos, sin))
        for (c, b, keep), y in zip(pieces, ys):
            if ins["residual"] is not None:
                y = (_load(ins["residual"].at[rows, pl.ds(c, b)], in_m, keep) + y).astype(seg.out_dtype)
            mask = [mk for mk in (in_m, keep) if mk is not None]
            pl_triton.store(
                out_ref.at[rows, pl.ds(c, b)], y, mask=functools.reduce(jnp.logical_and, mask) if mask else None
            )

    for seg, refs, out_ref in zip(segments, ins["segments"], outs):
        pl.when((p >= seg.first) & (p < seg.first + seg.count))(
            functools.partial(tile, seg, refs, out_ref, p - seg.first)
        )


def _pairs(a: jax.Array, pairs: int) -> jax.Array:
    """[..., N] -> [..., N/p, p] (a bitcast): the kernel's view of a segment's columns."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // pairs, pairs)


def fused_linear(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    biases: tuple[jax.Array | None, ...] | None = None,
    residual: jax.Array | None = None,
    head_dim: int | None = None,
    head_norms: tuple[jax.Array | None, ...] | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    rotate: tuple[bool, ...] | None = None,
    act=None,
    out_dtype=None,
    normed: bool = False,
    precision: str | None = None,
    tiles: Tiles = Tiles(),
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Rows x [M, K] times each weight segment W_i [K, N_i] (bf16 or f32) in one launch -> one
    output per segment, [M, N_i] ([M, N_i / 2] with act); with `normed`, the normed rows [M, K]
    first (what a later product of the same rows reads: the router's rows are the experts').

    norm [K], eps: x RMS-normed first (transformers' RMSNorm; eps also the head norms'). biases: per
    segment [N_i] or None, added to the rounded product in the output dtype (as the model's
    `q + q_bias`). head_dim with per segment head_norms ([head_dim] or None: an RMSNorm over each
    head of the rounded product) and rope = (cos, sin) [M, R/2] f32 with per segment `rotate`
    flags: rotate-half RoPE of each head's first R <= head_dim columns, after its norm. act: a
    static act(gate, up) over a single segment whose even columns are gate and odd ones up.
    residual [M, N] (one segment): its output is residual + the rounded product. out_dtype: every
    output's (None: each segment's product's, x's or the norm's dtype with the weight's).
    precision: None or "highest" (float32 products at full precision, not TF32). tiles: the
    blocks and launch shape. interpret: Pallas' interpreter (any platform).
    """
    _check_options(tiles, precision)
    _check_normed(normed, norm)
    segments = _segments(
        x,
        weights,
        norm=norm,
        biases=biases,
        residual=residual,
        head_dim=head_dim,
        head_norms=head_norms,
        rope=rope,
        rotate=rotate,
        act=act,
        out_dtype=out_dtype,
        tn=tiles.n,
    )
    m, k = x.shape
    tm, tk = _block(m, tiles.m), _block(k, tiles.k)
    ins = {
        "x": x,
        "norm": None if norm is None else norm.reshape(1, k),
        "segments": [
            {
                "w": _pairs(w, seg.pairs),
                "bias": None if b is None else _pairs(b.reshape(1, -1), seg.pairs),
                "head_norm": None if hn is None else hn.reshape(1, -1),
            }
            for w, b, hn, seg in zip(
                weights, biases or [None] * len(weights), head_norms or [None] * len(weights), segments
            )
        ],
        "rope": rope,
        "residual": residual,
    }
    flat, tree = jax.tree.flatten(ins)
    outs = [metadata.varying_struct((m, seg.n), seg.out_dtype, *flat) for seg in segments]
    if normed:
        outs.insert(0, metadata.varying_struct((m, k), jnp.result_type(norm.dtype, x.dtype), *flat))
    out_cols = sum(seg.n for seg in segments)
    kernel = functools.partial(
        _linear_kernel,
        tree=tree,
        n_in=len(flat),
        segments=segments,
        m=m,
        k=k,
        tm=tm,
        tk=tk,
        eps=eps,
        precision=precision,
        act=act,
        normed=normed,
    )
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=outs,
            grid=(segments[-1].first + segments[-1].count, pl.cdiv(m, tm)),
            compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
            interpret=interpret,
            cost_estimate=pl.CostEstimate(
                flops=2 * m * k * sum(w.shape[1] for w in weights),
                transcendentals=m * out_cols if act is not None else 0,
                bytes_accessed=sum(a.size * a.dtype.itemsize for a in flat)
                + sum(m * seg.n * seg.out_dtype.itemsize for seg in segments),
            ),
        )(*flat)
    )


def fused_linear_xla(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    biases: tuple[jax.Array | None, ...] | None = None,
    residual: jax.Array | None = None,
    head_dim: int | None = None,
    head_norms: tuple[jax.Array | None, ...] | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    rotate: tuple[bool, ...] | None = None,
    act=None,
    out_dtype=None,
    normed: bool = False,
    precision: str | None = None,
) -> tuple[jax.Array, ...]:
    """`fused_linear` with XLA ops: the same arguments (less its tiles) and results."""
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    _check_normed(normed, norm)
    segments = _segments(
        x,
        weights,
        norm=norm,
        biases=biases,
        residual=residual,
        head_dim=head_dim,
        head_norms=head_norms,
        rope=rope,
        rotate=rotate,
        act=act,
        out_dtype=out_dtype,
        tn=None,
    )
    m = x.shape[0]
    h = x if norm is None else _rms_norm(x, norm, eps)
    outs = []
    for i, (w, seg) in enumerate(zip(weights, segments)):
        acc = jnp.dot(
            h.astype(seg.cdtype), w.astype(seg.cdtype), preferred_element_type=jnp.float32, precision=precision
        )
        y = epilogue.finish(acc, seg.out_dtype, bias=None if biases is None else biases[i])
        if act is not None:
            y = epilogue.glu(*(c.astype(jnp.float32) for c in epilogue.gate_up_columns(y)), act).astype(seg.out_dtype)
        if seg.head_norm or seg.rotate:
            y = y.reshape(m, -1, head_dim)  # [M, H, Dh]
            if seg.head_norm:
                y = _rms_norm(y, head_norms[i], eps).astype(seg.out_dtype)
            if seg.rotate:
                half = rope[0].shape[-1]
                cos, sin = (a[:, None, :] for a in rope)
                yf = y[..., : 2 * half].astype(jnp.float32)
                rotated = jnp.concatenate(_rotate(yf[..., :half], yf[..., half:], cos, sin), axis=-1)
                y = jnp.concatenate([rotated.astype(seg.out_dtype), y[..., 2 * half :]], axis=-1)
            y = y.reshape(m, -1)
        if residual is not None:
            y = (residual + y).astype(seg.out_dtype)
        outs.append(y)
    return (h, *outs) if normed else tuple(outs)
