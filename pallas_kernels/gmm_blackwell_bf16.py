"""Grouped GEMM with bf16 rows and 4-bit (NVFP4 / MXFP4) weights on Blackwell (sm_100): Mosaic GPU tcgen05.

The rows are not quantized: each weight tile is decoded to bf16 on its way to the tensor core.
A CTA computes one (active row tile, N tile) of the product transposed, acc[n, m] = sum_k
w[k, n] x[m, k] in TMEM ("swap AB"): the decoded weights are the MMA's A operand, [LANES, tkb]
in tensor memory, where tcgen05 reads A and where thread n of a warpgroup writes row n (its
TMEM lane); the rows are its B operand [tkb, tm], K-major in shared memory as TMA loads them.
The MMA's M is the weights' 128 columns, so a tile of rows (the MMA's N) is 16 to 128 rows,
which a decode step's few rows per expert fill.

Weights are read as they are stored (`formats.QuantizedArray`: bytes [G, K/2, N], half-split
packing along K, block scales [G, K/B, N]), or one layer of a stack where it lies
(`layered.flat`). A K step loads tkb byte rows (`Tiles`): their low nibbles are K-half 0's rows
k0 + [0, tkb), their high nibbles K-half 1's rows K/2 + k0 + [0, tkb); thread n decodes its
weight column (`decode.py`, integer ops: no conversion that Mosaic lowers for sm_100 only)
into both halves, and the step is two MMAs, against the rows' columns of each half.

With a gated activation (`epilogue`), a CTA decodes LANES gate and LANES up columns (the stack's
[.., N/2, 2] column pairs, a reshape) into two accumulators, so thread n holds gate and up of
output column n; the epilogue applies the tensor scale, the column scales and the bias, then
act(gate, up), and writes [tm, LANES] of [M, N/2]. The transposed tile goes through shared memory
(thread n writes column n) and only its group's rows are stored.

Warp 0 issues the TMA loads, warp 1 the MMAs (`mgpu_blocks.warp_pipeline`), warpgroup 1 decodes (a
`steps`-deep ring) and runs the epilogue. The tile schedule is megablox's, as in the other kernels;
CTAs past the traced number of active tiles exit at once, so untouched groups' weights are never
loaded.

Status: compiled for a compile-only B200 (tests/test_blackwell.py), its decode checked on the CPU
against `formats.dequantize`; never run: no Blackwell GPU was available (tests/test_gpu.py runs it
on one), and JAX 0.10.2's Mosaic GPU interpreter has no tcgen05 / TMEM rules.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import decode, epilogue, formats, layered, metadata, mgpu_api, tiling
from pallas_kernels.mgpu_blocks import store_group_rows, warp_pipeline
from pallas_kernels.tiles import round_up

# Weight columns a CTA decodes per column set: TMEM's lanes, the MMA's M with A in TMEM, where thread n
# of the decoding warpgroup writes lane n (not a tile to choose: the layout has one thread a lane).
LANES = 128
# Thread n holds row n. Loads from shared memory (the weights' column n, the transposed out
# tile's column n) move one element a thread; arithmetic and TMEM stores take pairs.
ROWS1 = plgpu.Layout.TCGEN05_TMEM_NATIVE(1)
ROWS = plgpu.Layout.TCGEN05_TMEM_NATIVE(2)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's tiles (`tiles.lookup("blackwell_bf16", ..)`): tm rows a tile (the MMA's N: 16 to 128, a
    multiple of 16), tkb byte rows a K step loads (2 * tkb of K; the rows' tkb bf16 columns of each
    half, 128 bytes at 64: one swizzle), `steps` stages of the TMA / decode / MMA ring, and the
    epilogue's rows at a time (two [128, tm] f32 would fill the registers)."""

    tm: int
    tkb: int
    steps: int
    epilogue_rows: int


def fuses_glu(m: int, n: int, rhs) -> bool:
    """Whether the epilogue can halve a gate|up product of N columns (`shape_refusal`'s N, gated;
    its K is the kernel's to refuse, fused or not)."""
    return n % 16 == 0 and n >= 2 * LANES


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why [K, N] experts cannot be multiplied here in `tiles`, or None. TMA copies rows of whole
    16-byte units (the weights' rows of N bytes; the output's of N/2 bf16 with the activation) and
    reads zeros past an edge (a last K step, a last CTA's columns: any K and N), but an array holds
    one tile at least."""
    lanes = LANES * (2 if gated else 1)
    if n % 16 or n < lanes or k < 2 * tiles.tkb:
        least = f"K of at least {2 * tiles.tkb} and N of at least {lanes}, a multiple of 16"
        return f"the Blackwell bf16 x 4-bit kernel needs {least}; got K={k}, N={n}"
    return None


def dequantize_block(byte_cols: jax.Array, scale_lo: jax.Array, scale_hi: jax.Array, fmt: str):
    """byte_cols: uint8 [LANES, B], one scale block's bytes of each of LANES weight columns (a row a
    column: the half-split packing's low nibbles K-half 0's values, high nibbles K-half 1's);
    scale_lo / scale_hi: uint8 [LANES], the block's scale bits in each K-half -> the two halves'
    values [LANES, B] bf16, without the tensor scale (exact: e2m1 times a scale has at most 6
    significant bits)."""
    codes = byte_cols.astype(jnp.int32)
    spread = lambda bits: lax.broadcast_in_dim(decode.scale_to_f32(bits.astype(jnp.int32), fmt), codes.shape, (0,))
    return [
        decode.half_values(codes, h, spread(bits)).astype(jnp.bfloat16) for h, bits in enumerate((scale_lo, scale_hi))
    ]


def _kernel(
    sched,
    tscale,
    x_gmem,
    w_gmem,
    s_gmem,
    *refs,
    x_smem,
    w_smem,
    s_smem,
    out_smem,
    a_tmem,
    acc_tmem,
    tma_bar,
    dec_bar,
    consumed_bar,
    done_bar,
    fmt: str,
    block: int,
    tm: int,
    tkb: int,
    epilogue_rows: int,
    half_k: int,
    pairs: int,
    steps: int,
    tables: tuple[bool, bool],
    act,
):
    """One (active row tile t, N tile) CTA. x_gmem [M_pad, K] bf16; w_gmem bytes [G', K/2, N],
    s_gmem scale bits [G', K/B, N] (G': a stack's every layer's groups, the local ones sched.first[0] +
    [0, G_local)); a CTA reads LANES * p columns (p = `pairs`: 2 with act, LANES (gate, up) pairs) and
    decodes column set i of them (the gate ones, the up ones) into A tiles and accumulator i; the
    epilogue's column scales and bias [G_local, N/p, p] where `tables` says so; out_gmem [M_pad, N/p]."""
    *tables_gmem, out_gmem = refs
    cols_gmem = tables_gmem.pop(0) if tables[0] else None
    bias_gmem = tables_gmem.pop(0) if tables[1] else None
    t, n_i, wg = lax.axis_index("t"), lax.axis_index("n"), lax.axis_index("wg")
    sb = tkb // block  # scale rows of a K step, per half
    # K steps: the last one's rows past K/2 are TMA's zeros (its rows' columns, multiplied by them, are
    # in K-half 1 or zeros too), as are the columns past N of a last CTA, whose stores TMA skips.
    k_iters = pl.cdiv(half_k, tkb)

    @pl.when(sched.active(t))
    def _():
        g, local, m_tile, at = sched.tile(t)  # at: the group's weights
        rows, cols = pl.ds(m_tile * tm, tm), pl.ds(n_i * LANES * pairs, LANES * pairs)  # the weights' columns
        out_cols = pl.ds(n_i * LANES, LANES)

        def load(ki, slot):
            for h in range(2):
                k0 = h * half_k + ki * tkb
                plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds(k0, tkb)], x_smem.at[slot, h], tma_bar.at[slot])
                plgpu.copy_gmem_to_smem(
                    s_gmem.at[at, pl.ds(h * (half_k // block) + ki * sb, sb), cols],
                    s_smem.at[slot, h],
                    tma_bar.at[slot],
                )
            plgpu.copy_gmem_to_smem(w_gmem.at[at, pl.ds(ki * tkb, tkb), cols], w_smem.at[slot], tma_bar.at[slot])

        def mma(ki, slot):
            plgpu.barrier_wait(tma_bar.at[slot])  # the rows' tiles
            plgpu.barrier_wait(dec_bar.at[slot])  # the weights' tiles, decoded into TMEM
            for h in range(2):
                for i in range(pairs):
                    last = h == 1 and i == pairs - 1  # its commit tracks the step's every MMA
                    plgpu.tcgen05_mma(
                        acc_tmem.at[i],
                        a_tmem.at[(slot * 2 + h) * pairs + i],
                        x_smem.at[slot, h].transpose((1, 0)),
                        consumed_bar.at[slot] if last else None,
                        accumulate=(ki > 0) if h == 0 else True,
                    )

        @pl.when(wg == 0)
        def _():
            warp_pipeline(k_iters, steps, consumed_bar, done_bar, load, mma)

        @pl.when(wg == 1)
        def _():
            def dequantize(ki, _):
                slot = lax.rem(ki, steps)
                plgpu.barrier_wait(tma_bar.at[slot])

                @pl.when(ki >= steps)  # the MMAs of step ki - steps have read this slot's A tiles
                def _():
                    plgpu.barrier_wait(consumed_bar.at[slot])

                for i in range(pairs):
                    # Thread n reads weight column n: bytes [tkb, LANES] (column set i) read transposed.
                    w = w_smem.at[slot].reshape(tkb, LANES, pairs).at[:, :, i].transpose((1, 0))
                    for b in range(sb):
                        byte_cols = mgpu_api.load(w.at[:, pl.ds(b * block, block)], ROWS1, optimized=False)
                        scales = [
                            mgpu_api.load(
                                s_smem.at[slot, h, b].reshape(LANES, pairs).at[:, i], ROWS.reduce(1), optimized=False
                            )
                            for h in range(2)
                        ]
                        halves = dequantize_block(plgpu.layout_cast(byte_cols, ROWS), *scales, fmt)
                        for h, values in enumerate(halves):
                            a = a_tmem.at[(slot * 2 + h) * pairs + i]
                            plgpu.async_store_tmem(a.at[:, pl.ds(b * block, block)], values)
                plgpu.commit_tmem()
                plgpu.barrier_arrive(dec_bar.at[slot])

            lax.fori_loop(0, k_iters, dequantize, None)
            plgpu.barrier_wait(done_bar)
            # The column tables' [LANES] of this CTA, a thread's own column's entry each.
            tables_rows = [
                [
                    None
                    if table is None
                    else mgpu_api.load(table.at[local, out_cols, i], ROWS.reduce(1), optimized=False)
                    for table in (cols_gmem, bias_gmem)
                ]
                for i in range(pairs)
            ]
            for c in range(tm // epilogue_rows):  # a few rows at a time: two [LANES, tm] f32 would fill the registers
                ys = []
                for i, (col_scale, bias) in enumerate(tables_rows):
                    acc = plgpu.async_load_tmem(
                        acc_tmem.at[i].at[:, pl.ds(c * epilogue_rows, epilogue_rows)], layout=ROWS
                    )
                    spread = lambda v, shape=acc.shape: lax.broadcast_in_dim(v, shape, (0,))  # [LANES] -> [LANES, rows]
                    scale = tscale[at] if col_scale is None else tscale[at] * spread(col_scale)
                    ys.append(epilogue.finish(acc, out_smem.dtype, scale, None if bias is None else spread(bias)))
                # The activation's math is f32, as the Triton kernel's.
                y = ys[0] if act is None else epilogue.glu(*(y.astype(jnp.float32) for y in ys), act)
                out_rows = out_smem.at[pl.ds(c * epilogue_rows, epilogue_rows)].transpose((1, 0))
                out_rows[...] = plgpu.layout_cast(y.astype(out_smem.dtype), ROWS1)
            plgpu.commit_smem()
            store_group_rows(out_smem, out_gmem.at[:, out_cols], sched.offsets, g, m_tile, tm)


def gmm_blackwell_bf16(lhs, rhs, group_sizes, group_offset, out_dtype, *, tiles: Tiles, epilogue=None):
    """lhs [M, K] (bf16: the tensor core's type here), rhs a 4-bit QuantizedArray [G, K, N]
    along K, or one layer of a stack of them (`layered.LayerOf`) -> [M, N], or with `epilogue`
    (column scales, bias: [G_local, N] or None, act) [M, N/2] (`registry.grouped_gemm`).
    tiles: `Tiles`."""
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    rhs, first = layered.flat(rhs)
    if lhs.dtype != jnp.bfloat16:
        raise ValueError(f"the Blackwell bf16 x 4-bit kernel multiplies bf16 rows, got {lhs.dtype}")
    if not isinstance(rhs, formats.QuantizedArray):
        raise ValueError("the Blackwell bf16 x 4-bit kernel multiplies 4-bit experts (a QuantizedArray along K)")
    tables, has, act = tiling.epilogue_tables(epilogue, g_local)
    if refusal := shape_refusal(k, n, act is not None, tiles):
        raise ValueError(refusal)
    pairs = 1 if act is None else 2
    tm, tkb, steps = tiles.tm, tiles.tkb, tiles.steps
    if tm % 16 or not 16 <= tm <= 128:
        raise ValueError(f"a row tile is the MMA's N: 16 to 128 rows, a multiple of 16; got tm={tm}")
    block = rhs.spec.block
    lhs_p = tiling.pad_rows(lhs, tm)
    sched = tiling.gpu_schedule(group_sizes, group_offset, g_local, lhs_p.shape[0], tm, first)
    swizzle = plgpu.find_swizzle(tkb * 16)  # a K step's bf16 columns of one half
    x_transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))
    out_width = n // pairs
    width_pad = round_up(out_width, LANES)  # whole CTAs' columns of the column tables, read by plain loads
    # TMEM: a slot's A tiles (two halves, `pairs` column sets; bf16 two to a 32-bit column), the accumulators.
    scratch = dict(
        x_smem=plgpu.SMEM((steps, 2, tm, tkb), jnp.bfloat16, transforms=x_transforms),
        w_smem=plgpu.SMEM((steps, tkb, LANES * pairs), jnp.uint8),
        s_smem=plgpu.SMEM((steps, 2, tkb // block, LANES * pairs), jnp.uint8),
        out_smem=plgpu.SMEM((tm, LANES), out_dtype),
        a_tmem=plgpu.TMEM((steps * 2 * pairs, LANES, tkb), jnp.bfloat16, packed=True),
        acc_tmem=plgpu.TMEM((pairs, LANES, tm), jnp.float32),
        tma_bar=plgpu.Barrier(num_arrivals=5, num_barriers=steps),  # a step's copies: 2 x, 2 scales, 1 weights
        dec_bar=plgpu.Barrier(num_barriers=steps, orders_tensor_core=True),
        consumed_bar=plgpu.Barrier(num_barriers=steps, orders_tensor_core=True),
        done_bar=plgpu.Barrier(orders_tensor_core=True),
    )
    kernel = functools.partial(
        _kernel,
        fmt=rhs.fmt,
        block=block,
        tm=tm,
        tkb=tkb,
        epilogue_rows=tiles.epilogue_rows,
        half_k=k // 2,
        pairs=pairs,
        steps=steps,
        tables=has,
        act=act,
    )
    call = plgpu.kernel(
        kernel,
        out_type=metadata.varying_struct((lhs_p.shape[0], out_width), out_dtype, lhs, rhs, group_sizes, group_offset),
        grid=(sched.group_ids.shape[0], pl.cdiv(out_width, LANES)),
        grid_names=("t", "n"),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
        # Lane semantics, jax 0.10.2's default (0.11 made Warpgroup the default): the kernel places
        # every register array itself (a TMEM lane's row a thread) and reads strided SMEM views (a
        # column set of the interleaved gate/up pairs, transposed), which Warpgroup's layout
        # inference refuses (it takes only contiguous SMEM refs), as it refuses the rows' tiling
        # where the K-halves' TMA offsets (K/2 + k0) are not multiples of its 64 columns.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )
    out = call(
        sched,
        tiling.tensor_scales(rhs),
        lhs_p,
        rhs.values,
        tiling.scale_bits(rhs),
        *(jnp.pad(t.reshape(g_local, out_width, pairs), ((0, 0), (0, width_pad - out_width), (0, 0))) for t in tables),
    )
    return sched.zero_foreign_rows(out, g_local, m)
