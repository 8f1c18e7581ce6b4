"""`linear.fused_linear` on Hopper (sm_90) as one Mosaic GPU kernel (jax deprecated Pallas's Triton
backend): the same arguments, semantics and results, bf16 only (`refusal`).

A decode step's rows x [M, K] (M <= 128) times weight segments W_i [K, N_i]: a program (one
warpgroup) per (column tile of a segment, row tile of 64, K slice) streams its weight tile
[tk, tile] through shared memory with TMA over its K (`emit_pipeline`, `steps` stages) and
multiplies it by wgmma, whose M is 64: a row tile's [64, tk] TMA box over the M rows reads zeros
past them (no memory is read for them). Rows are padded in memory only past 8 and to whole 8-row
tiles (M 12 -> 16: a tiled TMA box's array has fewer rows than a tile or whole tiles).

- input RMSNorm: a first pipeline over x sums each row's squares (K in TMA's widest boxes); the
  main loop then norms each step's rows in registers (`normalize`, rounded as the model rounds)
  into a double-buffered shared tile that wgmma reads (a wgmma operand lies in shared memory).
- gated activation: gate and up interleave along N; the weights are read as int32 words of a
  (gate, up) pair and split in registers into two bf16 tiles (`mgpu_blocks.decoded_tiles`),
  each multiplied into its own accumulator; the epilogue writes act(gate, up) [M, N_i / 2].
- head epilogue (a program per head): the head's pieces (`Segment.pieces`: the rotated halves,
  then the columns past R) are column slices of the weight tile, an accumulator each, so the
  RMSNorm over the head and the rotate-half RoPE are elementwise on registers.
- bias and head norm columns are read from GMEM into registers; cos, sin and the residual come
  with TMA into shared memory (64-row boxes over M rows); each piece is written back by TMA
  (a box of the row tile's M rows).
- split-K (`Tiles.splits`): with too few column tiles to fill the SMs the K slices are a grid
  axis writing each column set's f32 products apart, [M, splits * p * V]; a second launch of the
  same kernel (`combine`) streams a tile's slices back through a TMA pipeline, sums them and runs
  the epilogue: two launches, as the Triton twin.

TMA wants 16-byte row strides: K and every N_i multiples of 8 (refused otherwise, as are pieces
of a head narrower than wgmma's 8 columns). An output of no whole column tiles is allocated whole
tiles wide and sliced after (the weight tile past N reads zeros). The normed rows (`normed`: the
router's call hands them to the experts) are written from registers by the programs of the first
column tile, each step's M rows (a TMA box of just those rows: jax's interpreter drops a copy
whose box runs past the array, where TMA would clip it), whole K steps wide (sliced after where
K is no whole steps).

What is verified without a GPU (tests/test_linear_mgpu.py): jax's Mosaic GPU interpreter against
float64 numpy, and the lowering and XLA:GPU compile for a compile-only H100. Not verified here:
the PTX's assembly and run on a GPU, nor its speed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import epilogue, metadata, mgpu_api
from pallas_kernels.gmm_mosaic_gpu import InterpretGPUParams, refusal
from pallas_kernels.linear_segments import (
    PRECISIONS,
    Segment,
    check_normed,
    normalize,
    rotate_half,
    segments,
    uniform_heads,
)
from pallas_kernels.mgpu_blocks import decoded_tiles, smem_transforms, store_rows, weight_words
from pallas_kernels.tiles import round_up

ROWS = 64  # a program's rows: a warpgroup's wgmma M
NORM_COLS = 256  # the norm pre-pass's K step: TMA's widest box


NAME = "linear_mgpu"  # its custom call's op_name ends ".../NAME/mpmd_map" (`moejax.compiled.hlo`)
K_FLOOR = 64  # the least K step the fill rule narrows to (`registry.fused_linear`): `Tiles.k`'s multiple


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's tiles (`tiles.lookup("linear_mgpu", ..)`): n output columns a program writes (a
    power of two, at least 16; a head segment's program writes a head), k K rows a pipeline step
    (a multiple of 64), splits slices of K (a power of two), steps pipeline stages (at least 2)."""

    n: int
    k: int
    splits: int
    steps: int


def _check(x, weights, laid_out, tiles: Tiles, precision):
    if precision not in PRECISIONS:
        raise ValueError(f"fused_linear: precision must be one of {PRECISIONS}, got {precision!r}")
    for dtype in (x.dtype, *(w.dtype for w in weights), *(seg.cdtype for seg in laid_out)):
        if reason := refusal(dtype):
            raise ValueError(f"linear_mgpu: {reason}")
    if x.shape[0] > 2 * ROWS:
        raise ValueError(f"linear_mgpu: at most {2 * ROWS} rows (a decode step's), got {x.shape[0]}")
    if x.shape[1] % 8 or any(w.shape[1] % 8 for w in weights):
        raise ValueError(f"linear_mgpu: K and every N must be multiples of 8 (TMA's 16-byte rows), got {x.shape[1]}")
    if any(w % 8 for seg in laid_out for _, w in seg.pieces):
        raise ValueError("linear_mgpu: a head's pieces (rotated halves, the rest) must be multiples of 8 columns")
    if tiles.n < 16 or tiles.n & (tiles.n - 1) or tiles.splits < 1 or tiles.splits & (tiles.splits - 1):
        raise ValueError(f"linear_mgpu: tiles.n ({tiles.n}) and tiles.splits ({tiles.splits}) must be powers of two")
    if tiles.k % 64 or tiles.steps < 2:
        raise ValueError(
            f"linear_mgpu: tiles.k ({tiles.k}) must be a multiple of 64 and tiles.steps ({tiles.steps}) >= 2"
        )


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why a product of K rows and N columns (or a head's piece of N columns) is not this kernel's
    (`catalog`'s shape check): its TMA boxes are 128-byte swizzled tiles of 64 columns, which an
    array's rows must be whole tiles of (a model's widths are)."""
    if k % 64 or n % 64:
        return f"K and N must be multiples of 64 (128-byte swizzled tiles), got K={k}, N={n}"
    return None


def _swizzle(seg: Segment) -> int:
    """The bf16 operands' swizzle: the widest that every piece's columns and first column fill."""
    return plgpu.find_swizzle(16 * math.gcd(seg.tile, *(v for piece in seg.pieces for v in piece)))


def _kernel(*refs, tree, n_in, segs, widths, m, k, tk, k_steps, splits, combine, steps, act, eps, normed, interpret):
    """Program (p, r, s): the output tile of whichever segment program p falls in, row tile r, K
    slice s. Refs are whole arrays in GMEM: x [M, K], norm [1, K]; per segment its weight [K, N/p]
    (p = 2 with act: int32 words of a (gate, up) pair), bias [p, W] (W: whole tiles), head norm
    [1, Dh]; cos, sin [M, R/2]; residual [M, N]; then the outputs [M, W]. With `splits` > 1 no
    epilogue: slice s's f32 products of column set i, [M, splits * p * V] (V: the segment's
    `widths`), at columns (s * p + i) * V. `combine`: no x, no norm; each segment's "weight" is
    such partials, summed over `combine` slices before the epilogue. `normed`: the normed rows
    [M, whole K steps] come first among the outputs, written by the programs p = 0."""
    ins, outs = jax.tree.unflatten(tree, refs[:n_in]), refs[n_in:]
    normed_ref, outs = (outs[0], outs[1:]) if normed else (None, outs)
    p, r, s = lax.axis_index("p"), lax.axis_index("r"), lax.axis_index("s")
    # The interpreter has no register layouts, and loads whole refs.
    cast = (lambda a, _: a) if interpret else plgpu.layout_cast
    load = (lambda ref, *_: ref[...]) if interpret else mgpu_api.load
    store = (lambda ref, value: ref.__setitem__(Ellipsis, value)) if interpret else mgpu_api.store_untiled
    wgmma = plgpu.Layout.WGMMA
    spread = lambda v, shape, dim: lax.broadcast_in_dim(v, shape, (dim,))  # noqa: E731
    rows = lambda a: a.at[pl.ds(r * ROWS, ROWS)]  # noqa: E731 (a row tile: TMA reads zeros past M)
    per_split = k_steps // splits

    rstd = None
    if ins["norm"] is not None:  # the rows' statistic: a first pass over x's K

        def square(_, x_smem, acc):
            xf = cast(x_smem[...], wgmma).astype(jnp.float32)
            return acc + jnp.sum(xf * xf, axis=1)

        cols = min(NORM_COLS, pl.cdiv(k, 64) * 64)
        spec = plgpu.BlockSpec((ROWS, cols), lambda i: (r, i), transforms=smem_transforms(cols, 16))
        zeros = cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1))
        sumsq = plgpu.emit_pipeline(
            square, grid=(pl.cdiv(k, cols),), in_specs=[spec], max_concurrent_steps=2, init_carry=zeros
        )(ins["x"])
        rstd = lax.rsqrt(sumsq / k + eps)  # [ROWS]

    def with_tma(body, *copies):  # body(*smem) after TMA copies [(GMEM ref, shape, dtype)] into SMEM
        if not copies:
            return body()

        def run(*smem):
            *smem, barrier = smem
            for (src, _, _), dst in zip(copies, smem):
                plgpu.copy_gmem_to_smem(src, dst, barrier)
            plgpu.barrier_wait(barrier)
            return body(*smem)

        bufs = [plgpu.SMEM(shape, dtype) for _, shape, dtype in copies]
        return pl.run_scoped(run, *bufs, plgpu.Barrier(num_arrivals=len(copies)))

    def products(seg: Segment, w_gmem, t):  # per piece, per column set: [ROWS, piece width] f32
        sw, pairs, width = _swizzle(seg), seg.pairs, seg.tile
        ks = lambda i: s * per_split + i  # noqa: E731
        specs = [
            plgpu.BlockSpec((ROWS, tk), lambda i: (r, ks(i)), transforms=smem_transforms(tk, 16, sw), delay_release=1),
            plgpu.BlockSpec(
                (tk, width),
                lambda i: (ks(i), t),
                transforms=smem_transforms(width, 16, sw) if pairs == 1 else smem_transforms(width, 32),
                delay_release=1,
            ),
        ]
        gmem = [ins["x"], w_gmem]
        if rstd is not None:
            specs.append(plgpu.BlockSpec((1, tk), lambda i: (0, ks(i)), delay_release=1))
            gmem.append(ins["norm"])
        # the normed rows, and the split (gate, up) tiles: two buffers each (a step's and the last's)
        h_buf = (
            plgpu.SMEM((2, ROWS, tk), jnp.bfloat16, transforms=smem_transforms(tk, 16, sw))
            if rstd is not None
            else None
        )
        dec_buf = plgpu.SMEM((2, pairs, tk, width), jnp.bfloat16, transforms=smem_transforms(width, 16, sw))
        dec_buf = dec_buf if pairs > 1 else None

        def mainloop(h_smem, dec_smem, accs):
            def step(indices, x_smem, w_smem, *norm_smem):
                slot = lax.rem(indices[0], 2)  # the wgmmas of two steps ago read it, and are done
                a = x_smem
                if rstd is not None:  # the step's rows normed, as the model rounds them
                    xf = cast(x_smem[...], wgmma).astype(jnp.float32)
                    nw = spread(load(norm_smem[0].at[0], wgmma.reduce(0)), (ROWS, tk), 1)
                    h = normalize(xf, spread(rstd, (ROWS, tk), 0), nw, jnp.bfloat16)
                    h_smem[slot] = h
                    a = h_smem.at[slot]
                    if normed_ref is not None:  # the programs p = 0 write them (M rows, whole K steps)
                        k0 = ks(indices[0]) * tk
                        pl.when(p == 0)(lambda: store_rows(h, normed_ref.at[:, pl.ds(k0, tk)], r, m, load, store))
                if pairs == 1:
                    bs = [w_smem if w == width else w_smem.at[:, pl.ds(off, w)] for off, w in seg.pieces]
                else:  # the (gate, up) words split into two bf16 tiles
                    tiles = decoded_tiles(w_smem, (), pairs=pairs, fmt=None, block=1, cast=cast, load=load)
                    for (i, _), values in tiles.items():
                        dec_smem[slot, i] = values.astype(jnp.bfloat16)
                    bs = [dec_smem.at[slot, i] for i in range(pairs)]
                if a is not x_smem or pairs > 1:
                    plgpu.commit_smem()  # the stores are visible to wgmma (the async proxy)
                for acc, b in zip(accs, bs):
                    plgpu.wgmma(acc, a, b)
                plgpu.wgmma_wait(len(accs))  # only this step's wgmmas run on

            plgpu.emit_pipeline(step, grid=(per_split,), in_specs=specs, max_concurrent_steps=steps)(*gmem)
            return [acc[...] for acc in accs]

        acc_shapes = [plgpu.ACC((ROWS, w), jnp.float32) for _, w in seg.pieces for _ in range(pairs)]
        bufs = [b for b in (h_buf, dec_buf) if b is not None]

        def scoped(*smem):
            it = iter(smem)
            h_smem, dec_smem = (None if b is None else next(it) for b in (h_buf, dec_buf))
            return pl.run_scoped(lambda *accs: mainloop(h_smem, dec_smem, accs), *acc_shapes)

        flat = pl.run_scoped(scoped, *bufs) if bufs else scoped()
        return [flat[j * pairs : (j + 1) * pairs] for j in range(len(seg.pieces))]

    def partial_sums(seg: Segment, parts, t, v):  # `products` of a split call: its partials summed
        def add(_, part_smem, acc):
            return acc + cast(part_smem[...], wgmma)

        zeros = cast(jnp.zeros((ROWS, seg.tile), jnp.float32), wgmma)
        sums = [
            plgpu.emit_pipeline(
                add,
                grid=(combine,),
                in_specs=[
                    plgpu.BlockSpec(
                        (ROWS, seg.tile),
                        lambda j, i=i: (r, (j * seg.pairs + i) * (v // seg.tile) + t),
                        transforms=smem_transforms(seg.tile, 32),
                    )
                ],
                max_concurrent_steps=steps,
                init_carry=zeros,
            )(parts)
            for i in range(seg.pairs)
        ]
        if len(seg.pieces) == 1:
            return [sums]

        def pieces(sum_smem):  # a head's pieces: column slices of its sum (one column set), through SMEM
            store(sum_smem, sums[0])
            plgpu.commit_smem()
            return [[load(sum_smem.at[:, pl.ds(off, w)], wgmma, False)] for off, w in seg.pieces]

        return pl.run_scoped(pieces, plgpu.SMEM((ROWS, seg.tile), jnp.float32))

    def tile(seg: Segment, refs, out_ref, t, v):  # segment seg's output tile t
        c0 = t * seg.tile
        if splits > 1:  # the products of K slice s, each column set's apart
            for (off, w), piece in zip(seg.pieces, products(seg, refs["w"], t)):
                for i, acc in enumerate(piece):
                    cols = pl.ds((s * seg.pairs + i) * v + c0 + off, w)
                    store_rows(acc, out_ref.at[:, cols], r, m, load, store)
            return
        sums = partial_sums(seg, refs["w"], t, v) if combine else products(seg, refs["w"], t)

        def column(ref, i, c, w):  # [ROWS, w]: row i of a table's columns [c, c + w), down every row
            return spread(load(ref.at[i, pl.ds(c, w)], wgmma.reduce(0), False), (ROWS, w), 1)

        ys = []
        for (off, w), piece in zip(seg.pieces, sums):
            bias = lambda i, off=off, w=w: None if refs["bias"] is None else column(refs["bias"], i, c0 + off, w)  # noqa: E731
            sets = [epilogue.finish(acc, seg.out_dtype, bias=bias(i)) for i, acc in enumerate(piece)]
            # the activation's math is f32, as the Triton twin's
            ys.append(sets[0] if act is None else epilogue.glu(*(y.astype(jnp.float32) for y in sets), act))
        ys = [y.astype(seg.out_dtype) for y in ys]
        if seg.head_norm:  # the head's statistic over its pieces
            yf = [y.astype(jnp.float32) for y in ys]
            head_rstd = lax.rsqrt(sum(jnp.sum(f * f, axis=1) for f in yf) / seg.tile + eps)  # [ROWS]
            ys = [
                normalize(f, spread(head_rstd, f.shape, 0), column(refs["head_norm"], 0, off, w), seg.out_dtype)
                for f, (off, w) in zip(yf, seg.pieces)
            ]
        if seg.rotate:  # pieces 0 and 1: the rotated halves

            def rotate(cos_smem, sin_smem):
                cos, sin = (load(a, wgmma, False) for a in (cos_smem, sin_smem))  # untiled: bank conflicts allowed
                return [
                    y.astype(seg.out_dtype) for y in rotate_half(*(y.astype(jnp.float32) for y in ys[:2]), cos, sin)
                ]

            half = seg.pieces[0][1]
            ys[:2] = with_tma(rotate, *((rows(a), (ROWS, half), a.dtype) for a in ins["rope"]))
        for (off, w), y in zip(seg.pieces, ys):
            residual = ins["residual"]
            copies = [] if residual is None else [(rows(residual).at[:, pl.ds(c0 + off, w)], (ROWS, w), residual.dtype)]
            with_tma(
                functools.partial(store_rows, y, out_ref.at[:, pl.ds(c0 + off, w)], r, m, load, store),
                *copies,
            )

    for seg, refs, out_ref, v in zip(segs, ins["segments"], outs, widths):
        pl.when((p >= seg.first) & (p < seg.first + seg.count))(
            functools.partial(tile, seg, refs, out_ref, p - seg.first, v)
        )


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
    tiles: Tiles,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """`linear.fused_linear` as a Mosaic GPU kernel: the same arguments and results (bf16 rows,
    norm and weights); `tiles`: this module's `Tiles`; `interpret`: jax's Mosaic GPU
    interpreter (any platform). `precision` is checked and otherwise moot: bf16 products are exact
    in f32."""
    check_normed(normed, norm)
    uniform_heads("linear_mgpu", head_dim)
    epilogue_args = dict(biases=biases, residual=residual, head_norms=head_norms, rope=rope, act=act)
    laid_out = segments(
        x, weights, norm=norm, head_dim=head_dim, rotate=rotate, out_dtype=out_dtype, tn=tiles.n, **epilogue_args
    )
    _check(x, weights, laid_out, tiles, precision)
    if interpret and InterpretGPUParams is None:
        raise ValueError(f"linear_mgpu: this jax ({jax.__version__}) has no Mosaic GPU interpreter")
    m, k = x.shape
    if pl.cdiv(k, tiles.k) % tiles.splits:
        raise ValueError(f"linear_mgpu: {tiles.splits} splits of K={k} in steps of {tiles.k} are no whole steps each")
    call = functools.partial(_call, m=m, eps=eps, tk=tiles.k, steps=tiles.steps, interpret=interpret)
    if tiles.splits == 1:  # outputs of no whole tiles sliced
        outs = call(x, weights, laid_out, norm=norm, normed=normed, **epilogue_args)
        h, outs = (outs[0][:, :k], outs[1:]) if normed else (None, outs)
        outs = tuple(out[:, : seg.n] for out, seg in zip(outs, laid_out))
        return (h, *outs) if normed else outs
    # Each K slice's f32 products of each column set, in column tiles (no head epilogue); then a
    # second launch sums them and runs the epilogue.
    products = segments(
        x, weights, norm=norm, head_dim=None, rotate=None, out_dtype=jnp.float32, tn=tiles.n, act=act,
        **dict.fromkeys(("biases", "residual", "head_norms", "rope")),
    )  # fmt: skip
    # A column set's partials: whole tiles of both launches' (the second reads them as its tiles).
    widths = [
        round_up(max(p.count * p.tile, seg.count * seg.tile), math.lcm(p.tile, seg.tile))
        for p, seg in zip(products, laid_out)
    ]
    parts = call(x, weights, products, norm=norm, normed=normed, widths=widths, splits=tiles.splits)
    h, parts = (parts[0][:, :k], parts[1:]) if normed else (None, parts)
    outs = call(None, parts, laid_out, widths=widths, combine=tiles.splits, **epilogue_args)
    outs = tuple(out[:, : seg.n] for out, seg in zip(outs, laid_out))
    return (h, *outs) if normed else outs


def _call(
    x, weights, laid_out, *, m, eps, tk, steps, interpret, norm=None, normed=False, widths=None, splits=1, combine=0,
    biases=None, residual=None, head_norms=None, rope=None, act=None,
) -> tuple[jax.Array, ...]:  # fmt: skip
    """The kernel's call over segments `laid_out` (`fused_linear`'s arguments, checked) -> per
    segment [M, W] (W: whole tiles); with `splits` > 1, the slices' partials [M', splits * p * V]
    f32 (M' = M, or whole 8-row tiles past 8, as x's TMA box wants); `combine`: x None, `weights`
    such partials, summed before the epilogue."""
    k = 0 if combine else x.shape[1]
    tables = []
    for seg, b in zip(laid_out, biases or [None] * len(weights)):
        if b is not None:  # [N] -> [p, W]: gate and up rows apart, whole tiles wide
            b = b.reshape(seg.n, seg.pairs).T
            b = jnp.pad(b, ((0, 0), (0, seg.count * seg.tile - seg.n)))
        tables.append(b)
    rows = m if m <= 8 else round_up(m, 8)  # a tiled TMA box's array: fewer rows than its 8-row tile, or whole tiles
    if x is not None and rows > m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
    ins = {
        "x": x,
        "norm": None if norm is None else norm.reshape(1, k),
        "segments": [
            {
                "w": w if combine else weight_words(w, seg.pairs),
                "bias": b,
                "head_norm": None if hn is None else hn.reshape(1, -1),
            }
            for w, b, hn, seg in zip(weights, tables, head_norms or [None] * len(weights), laid_out)
        ],
        "rope": rope,
        "residual": residual,
    }
    flat, tree = jax.tree.flatten(ins)
    if splits > 1:
        shapes = [(rows, splits * seg.pairs * v) for seg, v in zip(laid_out, widths)]
    else:
        shapes = [(m, seg.count * seg.tile) for seg in laid_out]
    out_type = [metadata.varying_struct(shape, seg.out_dtype, *flat) for shape, seg in zip(shapes, laid_out)]
    if normed:  # whole K steps wide
        out_type.insert(
            0, metadata.varying_struct((m, pl.cdiv(k, tk) * tk), jnp.result_type(norm.dtype, x.dtype), *flat)
        )
    kernel = functools.partial(
        _kernel,
        tree=tree,
        n_in=len(flat),
        segs=laid_out,
        widths=widths or [0] * len(laid_out),
        m=m,
        k=k,
        tk=tk,
        k_steps=pl.cdiv(k, tk),
        splits=splits,
        combine=combine,
        steps=steps,
        act=act,
        eps=eps,
        normed=normed,
        interpret=interpret,
    )
    # TMA reads zeros past an array's end; the interpreter does where its out-of-bounds reads give zeroed memory.
    params = InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero") if interpret else None
    # Lane semantics (jax 0.10.2's default; 0.11 made Warpgroup the default): the kernel places its register arrays.
    compiled = (
        {} if interpret else dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    )
    grid = (laid_out[-1].first + laid_out[-1].count, pl.cdiv(m, ROWS), splits)
    # The grid as a named scope around the call: a compiled Mosaic GPU call holds its module as
    # bytecode, and what reads the compiled program (its programs against the SMs) reads it here.
    with jax.named_scope("grid_" + "x".join(map(str, grid))):
        outs = plgpu.kernel(
            kernel,
            out_type=out_type,
            grid=grid,
            grid_names=("p", "r", "s"),
            kernel_name=NAME,
            interpret=params,
            **compiled,
        )(*flat)
    return tuple(outs)
