"""A decode step's dense products as one Triton kernel each (Pallas), and their XLA twin.

At a decode step's few rows XLA:GPU multiplies a projection as an elementwise product of the
weight's own shape and a reduce: a weight-sized temporary written and read back, and a launch for
every norm, bias, head norm and rotation around it. `fused_linear` is one launch that reads each
weight once: rows x [M, K] (optionally RMS-normed first) times weight segments W_i [K, N_i], each
column tile of a segment one program over all of K, its epilogue in registers: the bias, then a
per-head RMSNorm and rotate-half RoPE (attention's q and k), or the gated activation of a gate|up
product (writing [M, N_i / 2]), or a residual added. `linear_xla.fused_linear_xla` computes the
same with XLA ops, one product per segment; the tests hold both to the model's own functions.

MLA's projections (DeepSeek-V3, GLM-5) take three more options: each segment's heads of their own
width; the rotated columns from a head's column `rope_at` (the query's rope part follows its
non-rotated part), read from interleaved pairs (DeepSeek's layout: the pairs' even and odd columns
are the halves, read as every other column of the weight); and a segment as a window of its
weight's columns (kv_a: the latent's, then the rope key's, no copy of either).

Triton's blocks are powers of two and a dot's dims at least 16: rows, K and columns are read in
such blocks, masked past the arrays' ends (nothing beyond them is read, nothing written). A
segment with a head epilogue has a head per program, read as pieces of power-of-two blocks: the
rotated halves [0, R/2) and [R/2, R), then the columns past R.

A decode step's product of few column tiles (an output projection's N 2048 over 132 SMs, a router's
128 experts) leaves SMs idle with a program per tile: split over K (`Tiles.splits`), it is two
launches, the products of each K slice as f32 partials by programs (tile, slice), then their sum
and the epilogue by a program per tile (the same kernel, `combine`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import epilogue, metadata
from pallas_kernels.linear_segments import PRECISIONS, Segment, block, check_normed, normalize, rotate_half, segments
from pallas_kernels.tiles import pow2
from pallas_kernels.triton_blocks import column_pairs, iota, load

K_FLOOR = 32  # the least K step the fill rule narrows to (`registry.fused_linear`): two of Triton's least 16


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's blocks and launch shape (`tiles.lookup("fused_linear", ..)`; blocks and warps powers of
    two, blocks at least 16). A dim smaller than its block takes the smallest power of two of at least
    16 that covers it."""

    n: int  # output columns a program writes (a gate|up segment reads twice as many)
    k: int  # K rows of a step of the loop over K
    m: int  # rows a program holds; more rows are a second grid axis
    num_warps: int
    num_stages: int
    splits: int  # slices of K, a third grid axis: 1, or f32 partials summed by a second launch


def _check_options(tiles: Tiles, precision):
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    for name in ("n", "k", "m", "num_warps", "splits"):
        v = getattr(tiles, name)
        if v < 1 or v & (v - 1) or (name not in ("num_warps", "splits") and v < 16):
            raise ValueError(f"fused_linear: tiles.{name} must be a power of two (blocks at least 16), got {v}")
    if tiles.num_stages < 1:
        raise ValueError(f"fused_linear: tiles.num_stages must be at least 1, got {tiles.num_stages}")


def _linear_kernel(*refs, tree, n_in, segments, m, k, tm, tk, splits, combine, eps, precision, act, normed):
    """Program (p, r, s): row tile r of the output tile of whichever segment program p falls in,
    over K slice s of `splits`. Refs are whole arrays: x [M, K], norm [1, K], per segment its weight
    [K, N/p, p] (p: pairs), bias [1, N/p, p] and head norm [1, Dh]; cos, sin [M, R/2]; residual
    [M, N]; then the outputs: (`normed`: the normed rows [M, K], written by the programs p = s = 0)
    [M, splits * N/p], one per segment, slice s's columns [s * N/p, (s + 1) * N/p). `combine`: no
    product, but the sum of a split call's partials, each segment's "weight" [M, combine * N/p, p]
    f32 (no x, no norm), before the epilogue."""
    ins, outs = jax.tree.unflatten(tree, refs[:n_in]), refs[n_in:]
    # read outside pl.when: interpret mode wants it
    p, r, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pl.ds(r * tm, tm)
    in_m = None if m % tm == 0 else iota(tm, 0, r * tm) < m  # [tm, 1]
    steps = pl.cdiv(k, tk)
    per_split = steps // splits  # K steps of a slice (whole: `fused_linear` checks)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    def in_k(k0, axis):  # [tk, 1] or [1, tk]: which of a step's K rows lie in K
        return None if k % tk == 0 else iota(tk, axis, k0) < k

    def xblock(k0):  # [tm, tk]: the rows' K step
        return load(ins["x"].at[rows, pl.ds(k0, tk)], in_m, in_k(k0, 1))

    rstd = None
    if ins["norm"] is not None:  # the rows' statistic: a first pass over x's K

        def square(k_i, acc):
            xf = xblock(k_i * tk).astype(jnp.float32)
            return acc + xf * xf

        sumsq = lax.fori_loop(0, steps, square, jnp.zeros((tm, tk), jnp.float32))
        rstd = lax.rsqrt(jnp.sum(sumsq, axis=1, keepdims=True) / k + eps)  # [tm, 1]

    def hblock(k0):  # [tm, tk]: the rows' K step as the product reads them (normed in x's dtype)
        x = xblock(k0)
        if rstd is None:
            return x
        return normalize(x.astype(jnp.float32), rstd, load(ins["norm"].at[:, pl.ds(k0, tk)], in_k(k0, 1)), x.dtype)

    if normed:  # the normed rows for the products after this one (the router's rows: the experts')
        normed_ref, outs = outs[0], outs[1:]

        @pl.when((p == 0) & (s == 0))
        def _():
            def write(k_i, carry):
                k0 = k_i * tk
                mask = [mk for mk in (in_m, in_k(k0, 1)) if mk is not None]
                pl_triton.store(
                    normed_ref.at[rows, pl.ds(k0, tk)],
                    hblock(k0),
                    mask=functools.reduce(jnp.logical_and, mask) if mask else None,
                )
                return carry

            lax.fori_loop(0, steps, write, 0)

    def tile(seg: Segment, refs, out_ref, t):  # segment seg's output tile t: [tm, seg.tile]
        c0 = t * seg.tile
        # Each piece: its first output column, its block's width, and which of its columns are real.
        pieces, reads = [], []
        for (off, width), read in zip(seg.pieces, seg.reads):
            block = max(16, pow2(width))
            cols = iota(block, 1)
            keep = [cols < width] if block > width else []
            if seg.n % seg.tile:
                keep.append(cols + c0 + off < seg.n)
            pieces.append((c0 + off, block, functools.reduce(jnp.logical_and, keep) if keep else None))
            reads.append(read)
        # The column sets (all columns, or gate and up) as array indices: interpret mode's masked
        # loads take no Python int.
        sets = [jnp.int32(i) for i in range(seg.pairs)]

        def columns(ref, lead, first, c, b, i, read):  # a piece's block of ref [.., N], its columns from `first`
            first = first if combine else seg.start  # a product's window; a split call's partials are the window's
            if read is None:
                return refs[ref].at[lead, pl.ds(first + c, b), i]
            # every other column from the tile's column `read`: pair (first + c0 + read) // 2's member read % 2
            return refs[ref + "_pairs"].at[
                lead, pl.ds((first + read) // 2 + t * (seg.tile // 2), b), jnp.int32(read % 2)
            ]

        def step(k_i, accs):  # accs: per piece, per column set, [tm, block] f32
            k0 = (s * per_split + k_i) * tk
            h = hblock(k0).astype(seg.cdtype)
            return tuple(
                tuple(
                    acc + dot(h, load(columns("w", pl.ds(k0, tk), 0, c, b, i, r), in_k(k0, 0), keep).astype(seg.cdtype))
                    for i, acc in zip(sets, piece_accs)
                )
                for (c, b, keep), r, piece_accs in zip(pieces, reads, accs)
            )

        def add(s_i, accs):  # a split call's slice s_i of partial products, added
            return tuple(
                tuple(
                    acc + load(columns("w", rows, s_i * seg.n, c, b, i, r), in_m, keep)
                    for i, acc in zip(sets, piece_accs)
                )
                for (c, b, keep), r, piece_accs in zip(pieces, reads, accs)
            )

        zeros = tuple(tuple(jnp.zeros((tm, b), jnp.float32) for _ in sets) for _, b, _ in pieces)
        accs = lax.fori_loop(0, combine, add, zeros) if combine else lax.fori_loop(0, per_split, step, zeros)
        ys = [
            [
                epilogue.finish(
                    acc, seg.out_dtype, bias=load(refs["bias"].at[:, pl.ds(c, b), i], keep) if seg.bias else None
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
            # A piece's head norm columns from its first column's place in the head (traced: jax
            # checks a slice whose start it knows against the ref's width, which a masked block fails).
            ys = [
                normalize(f, head_rstd, load(refs["head_norm"].at[:, pl.ds(c % seg.tile, b)], keep), y.dtype)
                for f, y, (c, b, keep) in zip(yf, ys, pieces)
            ]
        if seg.rotate:  # pieces `rotated` and the next: the rotated halves
            r = seg.rotated
            c, b, keep = pieces[r]  # cos and sin's columns: the rotated half's in its head, from its first
            cos, sin = (load(a.at[rows, pl.ds(c % seg.tile - seg.pieces[r][0], b)], in_m, keep) for a in ins["rope"])
            halves = rotate_half(*(y.astype(jnp.float32) for y in ys[r : r + 2]), cos, sin)
            ys[r : r + 2] = (y.astype(seg.out_dtype) for y in halves)
        for (c, b, keep), y in zip(pieces, ys):
            if ins["residual"] is not None:
                y = (load(ins["residual"].at[rows, pl.ds(c, b)], in_m, keep) + y).astype(seg.out_dtype)
            mask = [mk for mk in (in_m, keep) if mk is not None]
            pl_triton.store(
                out_ref.at[rows, pl.ds(s * seg.n + c, b)],
                y,
                mask=functools.reduce(jnp.logical_and, mask) if mask else None,
            )

    for seg, refs, out_ref in zip(segments, ins["segments"], outs):
        pl.when((p >= seg.first) & (p < seg.first + seg.count))(
            functools.partial(tile, seg, refs, out_ref, p - seg.first)
        )


def fused_linear(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    biases: tuple[jax.Array | None, ...] | None = None,
    residual: jax.Array | None = None,
    head_dim: int | tuple[int | None, ...] | None = None,
    head_norms: tuple[jax.Array | None, ...] | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
    rotate: tuple[bool, ...] | None = None,
    rope_at: tuple[int, ...] | None = None,
    interleave: tuple[bool, ...] | None = None,
    windows: tuple[tuple[int, int] | None, ...] | None = None,
    act=None,
    out_dtype=None,
    normed: bool = False,
    precision: str | None = None,
    tiles: Tiles,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Rows x [M, K] times each weight segment W_i [K, N_i] (bf16 or f32) in one launch -> one
    output per segment, [M, N_i] ([M, N_i / 2] with act); with `normed`, the normed rows [M, K]
    first (what a later product of the same rows reads: the router's rows are the experts').

    norm [K], eps: x RMS-normed first (transformers' RMSNorm; eps also the head norms'). biases: per
    segment [N_i] or None, added to the rounded product in the output dtype (as the model's
    `q + q_bias`). head_dim with per segment head_norms ([head_dim] or None: an RMSNorm over each
    head of the rounded product) and rope = (cos, sin) [M, R/2] f32 with per segment `rotate`
    flags: rotate-half RoPE of each head's R columns from its column rope_at[i] (default 0), after
    its norm; per segment `interleave`: its columns come as pairs (x0, x1), (x2, x3)..., de-interleaved
    as they are read (DeepSeek's layout, as `apply_rope` with interleave). head_dim: one per segment where
    segments' heads differ (None where a segment has no head epilogue). windows: per segment, the
    columns [a, b) of its weight it multiplies (None: all; N_i its width). act: a
    static act(gate, up) over a single segment whose even columns are gate and odd ones up.
    residual [M, N] (one segment): its output is residual + the rounded product. out_dtype: every
    output's (None: each segment's product's, x's or the norm's dtype with the weight's).
    precision: None or "highest" (float32 products at full precision, not TF32). tiles: the
    blocks and launch shape; with K in `tiles.splits` slices (a decode product of too few column
    tiles to fill the GPU), a first launch writes each slice's f32 products [M, splits * N_i] and a
    second sums them and runs the epilogue (a small launch: it reads M * splits * N_i floats).
    interpret: Pallas' interpreter (any platform).
    """
    _check_options(tiles, precision)
    check_normed(normed, norm)
    epilogue_args = dict(biases=biases, residual=residual, head_norms=head_norms, rope=rope, act=act)
    laid_out = segments(
        x, weights, norm=norm, head_dim=head_dim, rotate=rotate, out_dtype=out_dtype, tn=tiles.n, rope_at=rope_at,
        interleave=interleave, windows=windows, **epilogue_args
    )  # fmt: skip
    m, k = x.shape
    tk = block(k, tiles.k)
    if pl.cdiv(k, tk) % tiles.splits:
        raise ValueError(f"fused_linear: {tiles.splits} splits of K={k} in steps of {tk} are no whole steps each")
    call = functools.partial(
        _call, x, weights, norm=norm, eps=eps, normed=normed, precision=precision, tiles=tiles, interpret=interpret
    )
    if tiles.splits == 1:
        return call(laid_out, **epilogue_args)
    # The products alone, each K slice's f32 partials [M, splits * N_i]; then their sum's epilogue.
    products = segments(
        x,
        weights,
        norm=norm,
        head_dim=None,
        rotate=None,
        out_dtype=jnp.float32,
        tn=tiles.n,
        windows=windows,
        **dict.fromkeys(epilogue_args),
    )
    results = call(products)
    h, parts = (results[0], results[1:]) if normed else (None, results)
    outs = _call(None, parts, laid_out, norm=None, eps=eps, normed=False, precision=precision, tiles=tiles,
                 interpret=interpret, combine=tiles.splits, **epilogue_args)  # fmt: skip
    return (h, *outs) if normed else outs


def _call(
    x, weights, laid_out, *, norm, eps, normed, precision, tiles, interpret, combine=0, biases=None, residual=None,
    head_norms=None, rope=None, act=None
) -> tuple[jax.Array, ...]:  # fmt: skip
    """The kernel's call over segments `laid_out` (`fused_linear`'s arguments, checked): per segment
    [M, tiles.splits * N_i], after the normed rows [M, K] where `normed`; or, `combine`, per segment
    [M, N_i] of the sums of a split call's partials `weights` [M, combine * N_i] (x None)."""
    m, k = (weights[0].shape[0], 0) if combine else x.shape
    splits = 1 if combine else tiles.splits
    tm, tk = block(m, tiles.m), block(k, tiles.k)
    ins = {
        "x": x,
        "norm": None if norm is None else norm.reshape(1, k),
        "segments": [
            {
                # [K, N/p, p] where a piece reads its own columns; [K, N/2, 2] where one reads pairs
                # de-interleaved (a split call's partials: [M, combine * N/p, p])
                "w": column_pairs(w, seg.pairs) if None in seg.reads else None,
                "w_pairs": column_pairs(w, 2) if set(seg.reads) - {None} else None,
                "bias": None if b is None else column_pairs(b.reshape(1, -1), seg.pairs),
                "head_norm": None if hn is None else hn.reshape(1, -1),
            }
            for w, b, hn, seg in zip(
                weights, biases or [None] * len(weights), head_norms or [None] * len(weights), laid_out
            )
        ],
        "rope": rope,
        "residual": residual,
    }
    flat, tree = jax.tree.flatten(ins)
    outs = [metadata.varying_struct((m, splits * seg.n), seg.out_dtype, *flat) for seg in laid_out]
    if normed:
        outs.insert(0, metadata.varying_struct((m, k), jnp.result_type(norm.dtype, x.dtype), *flat))
    out_cols = sum(seg.n for seg in laid_out)
    kernel = functools.partial(
        _linear_kernel,
        tree=tree,
        n_in=len(flat),
        segments=laid_out,
        m=m,
        k=k,
        tm=tm,
        tk=tk,
        splits=splits,
        combine=combine,
        eps=eps,
        precision=precision,
        act=act,
        normed=normed,
    )
    return tuple(
        pl.pallas_call(
            kernel,
            out_shape=outs,
            grid=(laid_out[-1].first + laid_out[-1].count, pl.cdiv(m, tm), splits),
            compiler_params=pl_triton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
            interpret=interpret,
            cost_estimate=pl.CostEstimate(
                flops=m
                * (sum(w.shape[1] for w in weights) if combine else 2 * k * sum(seg.n * seg.pairs for seg in laid_out)),
                transcendentals=m * out_cols if act is not None else 0,
                bytes_accessed=sum(a.size * a.dtype.itemsize for a in flat)
                + sum(m * splits * seg.n * seg.out_dtype.itemsize for seg in laid_out),
            ),
        )(*flat)
    )
