"""Grouped GEMM on Hopper (sm_90) as a Mosaic GPU kernel: TMA loads into shared memory, wgmma,
4-bit weights decoded on the way (jax 0.11 deprecated Pallas's Triton backend, `gmm_pallas_gpu`).

The twin of `gmm_pallas_gpu`: the same arguments, tile schedule, epilogue and result. The schedule
is megablox's metadata: one CTA per (active row tile, N tile) on the static bound of
M_pad / tm + G_local - 1 row tiles; CTAs past the traced number of active tiles exit at once, so
untouched groups' weights are never read. rhs may be one layer of a stack (`layered.LayerOf`): the
kernel reads the stack with its groups as one axis (`layered.flat`, a bitcast) at the layer's first
group, so no layer is copied out of it.

A CTA is one warpgroup: `plgpu.emit_pipeline` streams K through shared memory with TMA (`steps`
stages), and every wgmma reads both operands there (its B operand must be in shared memory, and
it takes bf16, not 4-bit, operands):
- bf16 weights without a gated activation: the weight tile [tk, tn] goes to wgmma as TMA left it.
- 4-bit weights: a step's bytes [tk/2, tn] hold the codes of two K-halves (`formats`); they and
  their scale rows are decoded in registers with integer ops (`decode`: Hopper has no float4 /
  float8 converts) into two bf16 tiles, stored into a double-buffered shared tile that the step's
  two wgmmas read with the rows' two K-halves. A block scale row [tn] reaches its block's K rows
  by selects on the row index (a register layout has no repeat along K).
- a gated activation (`epilogue`): gate and up interleave along N (gate in even columns), and
  neither TMA (rows of at least 16 bytes) nor wgmma (contiguous columns) can take every other
  column. So the weights are read as words of one (gate, up) pair (bf16 pairs as int32, 4-bit
  byte pairs as uint16: a bitcast of the operand, not a copy), split in registers into a gate and
  an up tile, each multiplied into its own accumulator [tm, tn/2]; the epilogue applies the column
  scales, the bias and act(gate, up) and writes [tm, tn/2].
The CTA writes only its group's rows of the tile, from shared memory by TMA in power-of-two row
pieces (a TMA box is static); rows no local group owns are never written and come out zero
(`tiling.zero_foreign_rows`).

Edges: TMA reads zeros past the end of M, K and N, so no tile is masked (a 4-bit tile past K/2
reads zero codes, whose products are 0 whatever the rows hold), the rows are not padded to whole
row tiles, and the output is allocated a whole number of N tiles wide and sliced after. TMA wants
every row stride of 16 bytes' multiple: widths that miss it (bf16 K or N not a multiple of 8,
4-bit N not a multiple of 16) are padded here, a copy of the layer's weights per call; models'
widths are multiples of 16 and read in place.

float32 is refused (`refusal`): wgmma multiplies float32 operands as TF32 (10 mantissa bits),
~1e-3 off where the project's float32 runs hold 1e-5 (`gmm_pallas_gpu` and `xla` multiply them at
full precision).

What is verified without a GPU (tests/test_mosaic_gpu_kernels.py): jax's Mosaic GPU interpreter
(`interpret=True`, which simulates TMA, barriers, shared memory and wgmma) runs the kernel against
a float64 reference; jax's Mosaic GPU lowering (register layouts, TMA descriptors' strides, wgmma
shapes and swizzles) runs here and XLA compiles the program for a compile-only H100 around one
`mosaic_gpu` custom call per product. Not verified here: the custom call's own PTX compilation
and run, which happen when the program is loaded on a GPU (`pytest -m gpu`, tests/test_gpu.py),
nor its speed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import epilogue, formats, layered, metadata, mgpu_api, tiling
from pallas_kernels.mgpu_blocks import decoded_tiles, operand_swizzle, smem_transforms, store_group_rows, weight_words
from pallas_kernels.tiles import round_up

try:  # jax's Mosaic GPU interpreter (jax >= 0.10.2) is not exported; only the tests run it
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - a jax without it runs the compiled kernel only
    InterpretGPUParams = None


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's tiles (`tiles.lookup("mosaic_gpu", ..)`; `_check_tiles` says what Hopper takes): tm rows
    (a multiple of 64), tk of K (bf16: a multiple of 64; 4-bit: of 128, two K-halves of tk/2), tn
    product columns (tn/2 outputs with act), `steps` pipeline stages."""

    tm: int
    tk: int
    tn: int
    steps: int


def refusal(dtype) -> str | None:
    """Why this kernel cannot multiply rows of `dtype` (4-bit experts are decoded to it; bf16
    experts are the rows' dtype), or None if it can. (The Mosaic GPU names it is built on are its
    catalog record's to check: `catalog.HOPPER_GEMM_API`.)"""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return (
            f"multiplies bfloat16 rows only, got {jnp.dtype(dtype).name}: Hopper's wgmma multiplies float32 as "
            "TF32 (10 mantissa bits, ~1e-3 off); triton or xla multiply float32 at full precision"
        )
    return None


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether the epilogue can halve a gate|up product of N columns: any whole (gate, up) pairs."""
    return n % 2 == 0


@dataclasses.dataclass(frozen=True)
class Product:
    """One CTA's [tm, tn] tile of a product, as a Hopper kernel's CTA computes it: the rows' tile m_tile
    times one group's weight columns n_i, the pipeline over K, then the epilogue (`__call__`). Both
    Hopper kernels run it: this grouped GEMM for each active (row tile, N tile) of its schedule, and
    `gmm_picks_mgpu` for each row tile holding picks of an expert. Made by `prepare`."""

    fmt: str | None
    block: int
    tm: int
    kt: int
    width: int
    k_steps: int
    steps: int
    pairs: int
    tables: tuple[bool, bool]
    act: object
    interpret: bool

    def refs(self, ins):
        """The operands' refs (`prepare`'s operands then tables, whole arrays in GMEM) -> (x, the
        weights' words, their scale words or None, column scales or None, bias or None)."""
        ins = list(ins)
        cols_ref = ins.pop(len(ins) - sum(self.tables)) if self.tables[0] else None
        bias_ref = ins.pop() if self.tables[1] else None
        x_gmem, w_gmem, s_gmem = (*ins, None)[:3]
        return x_gmem, w_gmem, s_gmem, cols_ref, bias_ref

    def __call__(self, ins, tscale, *, at, local, m_tile, n_i, out_dtype):
        """[tm, width] in out_dtype (registers): row tile m_tile of the rows times N tile n_i of group
        `local`'s weights (at `at` in the array read), scaled by tscale (a scalar), its epilogue applied.

        ins: the rows' K-halves (4-bit: x [M', 2, K/2]) or x [M', K] (M': `prepare`'s rows, row tiles
        past them read zeros); the weights' words [G', K or K/2, N/p] (p = `pairs`: 2 with act, a word
        holding a (gate, up) pair) and, 4-bit, their scale words [G', K/B, N/p]; the epilogue's column
        scales and bias [G_local, p, W] where `tables` says so (W: whole tiles of `width` output columns)."""
        x_gmem, w_gmem, s_gmem, cols_ref, bias_ref = self.refs(ins)
        fmt, block, tm, kt, width, pairs = self.fmt, self.block, self.tm, self.kt, self.width, self.pairs
        halves = 1 if fmt is None else 2
        # The interpreter has no register layouts (a layout cast has no CPU lowering there).
        cast = (lambda x, _: x) if self.interpret else plgpu.layout_cast
        # A load from GMEM into a layout is per element (`optimized=False`): only shared memory has vector plans.
        load = (lambda ref, *_: ref[...]) if self.interpret else mgpu_api.load
        direct = fmt is None and pairs == 1  # the weight tile goes to wgmma as TMA left it
        swizzle = operand_swizzle(min(kt, width), x_gmem.shape[-1])  # the bf16 operands' (x and weight tiles)
        words = (
            smem_transforms(width, 16, swizzle)
            if direct
            else smem_transforms(width, jnp.dtype(w_gmem.dtype).itemsize * 8)
        )
        x_spec = plgpu.BlockSpec(
            (tm, kt), lambda k: (m_tile, k), transforms=smem_transforms(kt, 16, swizzle), delay_release=1
        )
        w_spec = plgpu.BlockSpec((kt, width), lambda k: (k, n_i), transforms=words, delay_release=1)
        if fmt is None:
            specs, gmem = [x_spec, w_spec], [x_gmem, w_gmem.at[at]]
        else:  # the K-halves' rows and scale rows as views (past K/2 the codes read zero, so their tiles may overrun)
            kh = s_gmem.shape[1] // 2  # scale rows per K-half
            s_spec = plgpu.BlockSpec((kt // block, width), lambda k: (k, n_i), delay_release=1)
            specs = [x_spec, x_spec, w_spec, s_spec, s_spec]
            gmem = [
                x_gmem.at[:, 0],
                x_gmem.at[:, 1],
                w_gmem.at[at],
                *(s_gmem.at[at, pl.ds(h * kh, kh)] for h in (0, 1)),
            ]

        def mainloop(dec_smem, *accs):  # dec_smem: [2 slots, pairs, halves, kt, width] bf16, or None
            def step(indices, *smem):
                x_smem, (w_smem, *s_smem) = smem[:halves], smem[halves:]
                if direct:
                    plgpu.wgmma(accs[0], x_smem[0], w_smem)
                    plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its slots refill
                    return
                slot = lax.rem(indices[0], 2)  # the wgmmas of two steps ago read it, and are done
                tiles = decoded_tiles(w_smem, s_smem, pairs=pairs, fmt=fmt, block=block, cast=cast, load=load)
                for (i, h), tile in tiles.items():
                    dec_smem[slot, i, h] = tile.astype(jnp.bfloat16)
                plgpu.commit_smem()  # the stores are visible to wgmma (the async proxy)
                for i, h in tiles:
                    plgpu.wgmma(accs[i], x_smem[h], dec_smem.at[slot, i, h])
                plgpu.wgmma_wait(len(tiles))  # only this step's wgmmas run on

            plgpu.emit_pipeline(step, grid=(self.k_steps,), in_specs=specs, max_concurrent_steps=self.steps)(*gmem)
            return tuple(acc[...] for acc in accs)

        # Accumulators in registers and the decoded tiles in shared memory are scoped apart.
        accumulate = lambda dec_smem: pl.run_scoped(
            lambda *accs: mainloop(dec_smem, *accs), *[plgpu.ACC((tm, width), jnp.float32)] * pairs
        )
        if direct:
            accs = accumulate(None)
        else:
            dec = plgpu.SMEM(
                (2, pairs, halves, kt, width), jnp.bfloat16, transforms=smem_transforms(width, 16, swizzle)
            )
            accs = pl.run_scoped(accumulate, dec)

        cols = pl.ds(n_i * width, width)

        def column(ref, i):  # [tm, width]: row i of a group's epilogue table, down every row
            row = load(ref.at[local, i, cols], plgpu.Layout.WGMMA.reduce(0), False)
            return lax.broadcast_in_dim(row, (tm, width), (1,))

        ys = [
            epilogue.finish(
                acc,
                out_dtype,
                tscale * (1.0 if cols_ref is None else column(cols_ref, i)),
                None if bias_ref is None else column(bias_ref, i),
            )
            for i, acc in enumerate(accs)
        ]
        # The activation's math is f32, as the Triton twin's (whose bf16 has no division).
        return (
            ys[0]
            if self.act is None
            else epilogue.glu(*(y.astype(jnp.float32) for y in ys), self.act).astype(out_dtype)
        )


def _kernel(sched, tscale, *refs, product: Product):
    """One (active m tile, n tile) CTA: its `product` tile, of which it writes its group's rows.
    Refs are whole arrays in GMEM: tscale [G'], whose local groups are sched.first[0] + [0, G_local)
    (G': a stack's every layer's groups), `Product`'s operands, out [M_pad, W]."""
    *ins, out_gmem = refs
    t, n_i = lax.axis_index("t"), lax.axis_index("n")

    @pl.when(sched.active(t))
    def _():
        g, local, m_tile, at = sched.tile(t)  # at: the group's weights
        y = product(ins, tscale[at], at=at, local=local, m_tile=m_tile, n_i=n_i, out_dtype=out_gmem.dtype)

        def store(out_smem):  # only this group's rows of the tile
            out_smem[...] = y
            plgpu.commit_smem()
            cols = out_gmem.at[:, pl.ds(n_i * product.width, product.width)]
            store_group_rows(out_smem, cols, sched.offsets, g, m_tile, product.tm, read_only_wait=True)

        pl.run_scoped(store, plgpu.SMEM((product.tm, product.width), out_gmem.dtype))


def _pad(a, axis: int, multiple: int):
    """a padded with zeros along `axis` to a multiple of `multiple`."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, round_up(a.shape[axis], multiple) - a.shape[axis])
    return jnp.pad(a, pad)


def _check_tiles(
    tm: int,
    tk: int,
    tn: int,
    steps: int,
    pairs: int,
    quantized: bool,
    out_dtype,
    kernel: str = "mosaic_gpu",
    padded_rows: bool = False,
) -> None:
    width = tn // pairs
    row_bytes = width * jnp.dtype(out_dtype).itemsize
    if tm % 64:
        raise ValueError(f"{kernel}: tm={tm} must be a multiple of 64 (a warpgroup's wgmma rows)")
    # A tile loaded into registers has the wgmma layout's 64-row tiles; 4-bit steps hold two K-halves.
    if tk % (128 if quantized else 64):
        raise ValueError(f"{kernel}: tk={tk} must be a multiple of {128 if quantized else 64}")
    # A TMA copy's shared-memory rows start 128-byte aligned: the row pieces of the output tile (or,
    # `padded_rows`, a kernel storing its tile's rows 128 bytes apart: a row of 128 bytes' part).
    if tn % (32 * pairs) or width > 256 or (128 % row_bytes if padded_rows and row_bytes < 128 else row_bytes % 128):
        raise ValueError(
            f"{kernel}: tn={tn} must be a multiple of {32 * pairs} whose tn/{pairs} output columns are at most "
            f"256 (wgmma's N) and a multiple of 128 bytes of {jnp.dtype(out_dtype).name}"
            + (" or a part of 128 bytes" if padded_rows else "")
        )
    if steps < 2:
        raise ValueError(f"{kernel}: steps={steps} must be at least 2 (a step's tiles are read while the next load)")


class Prepared(NamedTuple):
    """A Hopper product's CTA work (`product`) and its operands (`prepare`)."""

    product: Product
    operands: tuple  # `Product`'s operands: the rows, the weights' words (and 4-bit scale words), the tables
    tscale: jax.Array  # [G'] f32: the groups' tensor scales (1 for bf16 and MXFP4 experts)
    first: jax.Array  # [1]: the local groups' first in the array read (`layered.flat`)
    m_pad: int  # the rows' whole tiles of tm (the operand's rows are not padded to them)
    grid_n: int  # N tiles


def prepare(
    lhs,
    rhs,
    out_dtype,
    tiles: Tiles,
    epilogue,
    interpret: bool,
    kernel: str = "mosaic_gpu",
    padded_rows: bool = False,
) -> Prepared:
    """What a Hopper kernel's CTAs read for lhs [M, K] times rhs (the local groups [G_local, K, N], an
    array or a 4-bit QuantizedArray, or a `layered.LayerOf` either) with `epilogue`, after one clear
    error (prefixed `kernel`) for operands or tiles it cannot take: bf16 rows (`refusal`), Hopper's
    tiles (`_check_tiles`; `padded_rows`: the kernel stores output rows narrower than 128 bytes
    from rows 128 bytes apart), a jax with an interpreter where `interpret`."""
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    quantized = isinstance(layered.stored(rhs), formats.QuantizedArray)
    reason = refusal(lhs.dtype) or (None if quantized else refusal(layered.stored(rhs).dtype))
    if reason:
        raise ValueError(f"{kernel}: {reason}")
    if interpret and InterpretGPUParams is None:
        raise ValueError(f"{kernel}: this jax ({jax.__version__}) has no Mosaic GPU interpreter")
    tables, has, act = tiling.epilogue_tables(epilogue, g_local)
    pairs = 1 if act is None else 2
    tm, tk, tn, steps = tiles.tm, tiles.tk, tiles.tn, tiles.steps
    _check_tiles(tm, tk, tn, steps, pairs, quantized, out_dtype, kernel, padded_rows)
    width, kt = tn // pairs, tk // 2 if quantized else tk
    # TMA strides: every row a multiple of 16 bytes. Widths that miss it are padded, which copies
    # the layer's weights out of a stack.
    lane = 16 if quantized else 8
    if k % lane or n % lane:
        rhs = layered.layer_slice(rhs.stack, rhs.index) if isinstance(rhs, layered.LayerOf) else rhs
        if quantized:
            rhs = rhs.replace(values=_pad(rhs.values, -1, lane), scales=_pad(rhs.scales, -1, lane))
        else:
            lhs, rhs = _pad(lhs, 1, lane), _pad(_pad(rhs, 1, lane), 2, lane)
    rhs, first = layered.flat(rhs)
    # A row tile's TMA box reads zeros past M, so the rows are not padded to whole row tiles (a copy
    # and a launch per call); only to whole 8-row tiles past 8, as a tiled TMA box's array wants
    # (fewer rows than its 8-row tile, or whole tiles).
    rows = m if m <= 8 else round_up(m, 8)
    lhs_p = jnp.pad(lhs, ((0, rows - m), (0, 0))) if rows > m else lhs
    if quantized:
        kh = k // 2
        operands = (
            lhs_p.reshape(rows, 2, kh),  # the two K-halves, each with its own end for TMA
            weight_words(rhs.values, pairs),
            weight_words(tiling.scale_bits(rhs), pairs),
        )
        tscale, fmt, block, k_steps = tiling.tensor_scales(rhs), rhs.fmt, rhs.spec.block, pl.cdiv(kh, kt)
    else:
        operands = (lhs_p, weight_words(rhs, pairs))
        tscale, fmt, block, k_steps = jnp.ones(rhs.shape[:1], jnp.float32), None, 1, pl.cdiv(lhs_p.shape[1], kt)
    # The epilogue's tables [G_local, 1, N] -> [G_local, p, W]: gate and up rows apart, whole tiles wide.
    tables = [_pad(t.reshape(g_local, n // pairs, pairs).transpose(0, 2, 1), -1, width) for t in tables]
    product = Product(fmt, block, tm, kt, width, k_steps, steps, pairs, has, act, interpret)
    return Prepared(product, (*operands, *tables), tscale, first, round_up(m, tm), pl.cdiv(n, tn))


def interpret_params(interpret: bool):
    """The Mosaic GPU interpreter's parameters where `interpret` (else None): TMA reads zeros past an
    array's end; the interpreter does where its out-of-bounds reads give zeroed memory."""
    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero") if interpret else None


def gmm_mosaic_gpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_dtype,
    *,
    tiles: Tiles,
    interpret: bool = False,
    epilogue=None,
):
    """The Mosaic GPU twin of `gmm_pallas_gpu`: the same arguments, epilogue and result (rhs may be
    one layer of a stack, `layered.LayerOf`); bf16 rows only (`refusal`). tiles: `Tiles`;
    `interpret`: jax's Mosaic GPU interpreter (on any platform)."""
    m, g_local, n = lhs.shape[0], rhs.shape[0], rhs.shape[2]
    prep = prepare(lhs, rhs, out_dtype, tiles, epilogue, interpret)
    sched = tiling.gpu_schedule(group_sizes, group_offset, g_local, prep.m_pad, tiles.tm, prep.first)
    width = prep.product.width
    out = plgpu.kernel(
        functools.partial(_kernel, product=prep.product),
        out_type=metadata.varying_struct(
            (prep.m_pad, prep.grid_n * width), out_dtype, lhs, rhs, group_sizes, group_offset
        ),
        grid=(sched.group_ids.shape[0], prep.grid_n),
        grid_names=("t", "n"),
        interpret=interpret_params(interpret),
    )(sched, prep.tscale, *prep.operands)
    return sched.zero_foreign_rows(out, g_local, m)[:, : n // prep.product.pairs]
