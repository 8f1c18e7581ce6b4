"""Grouped GEMM with 4-bit rows and 4-bit weights on Blackwell (sm_100): Mosaic GPU tcgen05.

The rows are quantized to the weights' format (one tensor scale for all rows), and each
(active row tile, N tile) CTA runs the block-scaled `tcgen05_mma(..., a_scale=, b_scale=)`
on float4_e2m1fn operands: the tensor core applies the e4m3 (NVFP4, 16 values) or e8m0
(MXFP4, 32 values) block scales itself, so the f32 accumulator stays in TMEM across all of
K; the epilogue multiplies in the two tensor scales and stores only the rows of its group.
The tile schedule is megablox's, as in the other kernels; CTAs past the traced number of
active tiles exit at once, so untouched groups' weights are never loaded.

Operands must be K-major for 4-bit MMA and the scales in the tiling tcgen05 block scaling reads
from TMEM, so the weights are converted once by `prepare_weights` (at load time), never per call;
one layer of a run's stack of them is read where it lies (`layered.flat`). Warp 0 issues the TMA
loads, warp 1 the MMAs (a `steps`-deep ring: `mgpu_blocks.warp_pipeline`), warpgroup 1 stores.

Status: compiled for a compile-only B200 (tests/test_blackwell.py: XLA:GPU's compile runs Mosaic
GPU's, to PTX for sm_100a and through ptxas); never run: no Blackwell GPU was available, and JAX
0.10.2's Mosaic GPU interpreter has no tcgen05 / TMEM rules.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import formats, layered, metadata, tiling
from pallas_kernels.mgpu_blocks import store_group_rows, warp_pipeline
from pallas_kernels.tiles import round_up


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A call's tiles (`tiles.lookup("blackwell", ..)`): tm rows and tn columns of a CTA (a 128-lane
    TMEM tile each), tk of K a step (4 * 32 values: whole block-scale tiles of the MMA's scale
    layout), `steps` stages of the TMA / MMA ring. K and N are multiples of tk and tn."""

    tm: int
    tn: int
    tk: int
    steps: int


@flax.struct.dataclass
class BlackwellWeights:
    """Experts [.., G, K, N] as the kernel reads them (a run's stack: leading layer axes).

    values: float4_e2m1fn [.., G, N, K] (K-major); scales: [.., G, N/128, K/B/4, 32, 16] in the
    MMA scale tiling; group_scale: f32 [.., G], each expert's NVFP4 tensor scale (1: MXFP4, or
    gate and up scaled apart), which the kernel applies; tensor_scale: None, or f32 [.., G, N]
    column-wise (gate and up halves of a gate_up stack), which `registry.grouped_gemm` finds
    there and applies after the kernel (or hands it in as unit scales: the kernel never reads
    it). Kept apart so that a stack's per-expert scales [L, G] are never taken for columns."""

    values: jax.Array
    scales: jax.Array
    group_scale: jax.Array
    tensor_scale: jax.Array | None
    fmt: str = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, k = self.values.shape
        return (*lead, k, n)


def _to_f4(codes: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)


def _mma_scale_tiling(s: jax.Array) -> jax.Array:
    """[.., MN, K/B] row-major scales -> [.., MN/128, K/B/4, 32, 16], the `.scale_vec::1X`
    layout async_copy_scales_to_tmem reads (PTX ISA, tcgen05 block scaling)."""
    *lead, mn, ks = s.shape
    s = s.reshape(*lead, mn // 128, 4, 32, ks // 4, 4)
    s = jnp.moveaxis(s, -2, -4)  # [.., mn/128, ks/4, 4, 32, 4]
    s = jnp.swapaxes(s, -3, -2)  # [.., mn/128, ks/4, 32, 4, 4]
    return s.reshape(*lead, mn // 128, ks // 4, 32, 16)


def _k_major(q: formats.QuantizedArray) -> tuple[jax.Array, jax.Array]:
    """QuantizedArray [.., K, N] along K -> f4 values [.., N, K] and scales [.., N, K/B]."""
    codes = formats.unpack_codes(q.values, q.axis)  # [.., K, N] logical order
    return _to_f4(jnp.swapaxes(codes, -1, -2)), jnp.swapaxes(q.scales, -1, -2)


def prepare_weights(q: formats.QuantizedArray) -> BlackwellWeights:
    """q [G, K, N] quantized along K -> the kernel's layout (done once, at load time)."""
    if q.axis != -2 or q.ndim != 3:
        raise ValueError("expected stacked experts [G, K, N] quantized along K")
    values, scales = _k_major(q)
    g = q.shape[0]
    if q.tensor_scale is not None and q.tensor_scale.shape[-1] != 1:  # column-wise
        return BlackwellWeights(
            values, _mma_scale_tiling(scales), jnp.ones((g,), jnp.float32), q.tensor_scale.reshape(g, -1), q.fmt
        )
    return BlackwellWeights(values, _mma_scale_tiling(scales), tiling.tensor_scales(q), None, q.fmt)


def _prepare_rows(lhs: jax.Array, fmt: str, m_pad: int):
    """lhs [M, K] -> f4 [M_pad, K], MMA-tiled scales, and the one f32 tensor scale."""
    x = jnp.pad(lhs, ((0, m_pad - lhs.shape[0]), (0, 0)))
    q = formats.quantize(x, fmt, axis=-1)  # one tensor scale: the matrix [M_pad, K]
    values = _to_f4(formats.unpack_codes(q.values, -1))
    scale = jnp.ones((), jnp.float32) if q.tensor_scale is None else q.tensor_scale.reshape(())
    return values, _mma_scale_tiling(q.scales), scale


def _kernel(
    sched,
    w_scale,
    x_scale,
    a_gmem,
    b_gmem,
    a_sc_gmem,
    b_sc_gmem,
    out_gmem,
    a_smem,
    b_smem,
    a_sc_smem,
    b_sc_smem,
    out_smem,
    a_sc_tmem,
    b_sc_tmem,
    acc_tmem,
    tma_barrier,
    consumed_barrier,
    mma_done_barrier,
    *,
    k_iters: int,
    steps: int,
    block: int,
    tm: int,
    tn: int,
    tk: int,
):
    t, n_i, wg = lax.axis_index("t"), lax.axis_index("n"), lax.axis_index("wg")

    @pl.when(sched.active(t))
    def _():
        g, _, m_tile, at = sched.tile(t)  # at: the group's weights
        rows, cols = pl.ds(m_tile * tm, tm), pl.ds(n_i * tn, tn)
        sc_k = tk // block // 4  # scale tiles per K step

        def load(ki, slot):
            ks, kss = pl.ds(ki * tk, tk), pl.ds(ki * sc_k, sc_k)
            plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], tma_barrier.at[slot])
            plgpu.copy_gmem_to_smem(b_gmem.at[at, cols, ks], b_smem.at[slot], tma_barrier.at[slot])
            plgpu.copy_gmem_to_smem(a_sc_gmem.at[pl.ds(m_tile, 1), kss], a_sc_smem.at[slot], tma_barrier.at[slot])
            plgpu.copy_gmem_to_smem(b_sc_gmem.at[at, pl.ds(n_i, 1), kss], b_sc_smem.at[slot], tma_barrier.at[slot])

        def mma(ki, slot):
            plgpu.barrier_wait(tma_barrier.at[slot])
            plgpu.async_copy_scales_to_tmem(a_sc_smem.at[slot], a_sc_tmem)
            plgpu.async_copy_scales_to_tmem(b_sc_smem.at[slot], b_sc_tmem)
            plgpu.tcgen05_mma(
                acc_tmem,
                a_smem.at[slot],
                b_smem.at[slot].transpose((1, 0)),
                consumed_barrier.at[slot],
                a_scale=a_sc_tmem,
                b_scale=b_sc_tmem,
                accumulate=ki > 0,
            )

        @pl.when(wg == 0)
        def _():
            warp_pipeline(k_iters, steps, consumed_barrier, mma_done_barrier, load, mma)

        @pl.when(wg == 1)
        def _store():
            plgpu.barrier_wait(mma_done_barrier)
            acc = plgpu.async_load_tmem(acc_tmem) * (w_scale[at] * x_scale[0])
            out_smem[...] = acc.astype(out_smem.dtype)
            plgpu.wait_load_tmem()
            plgpu.commit_smem()
            store_group_rows(out_smem, out_gmem.at[:, cols], sched.offsets, g, m_tile, tm)


def gmm_blackwell(lhs, rhs, group_sizes, group_offset, out_dtype, *, tiles: Tiles):
    """lhs [M, K] (quantized here to rhs.fmt), rhs from `prepare_weights`, or one layer of a
    stack of them (`layered.LayerOf`, read where it lies: `layered.flat`) -> [M, N]; tiles: `Tiles`.

    A QuantizedArray rhs is converted on every call (a full pass over the weights): prepare
    it once instead.
    """
    if isinstance(rhs, formats.QuantizedArray):
        rhs = prepare_weights(rhs)
    m, k = lhs.shape
    g_local, _, n = rhs.shape
    rhs, first = layered.flat(rhs)
    if not isinstance(rhs, BlackwellWeights):
        raise ValueError("a layer of a stack reaches the blackwell kernel prepared (`prepare_weights`, at load)")
    if rhs.tensor_scale is not None and rhs.tensor_scale.ndim > 1:
        raise ValueError("column-wise tensor scales [G, N] are applied by grouped_gemm, after the blackwell kernel")
    block = formats.FORMATS[rhs.fmt].block
    tm, tn, tk, steps = tiles.tm, tiles.tn, tiles.tk, tiles.steps
    if k % tk or n % tn:
        raise ValueError(f"blackwell: K={k} and N={n} must be multiples of {tk} and {tn}")
    m_pad = round_up(m, tm)
    a, a_sc, x_scale = _prepare_rows(lhs, rhs.fmt, m_pad)
    sched = tiling.gpu_schedule(group_sizes, group_offset, g_local, m_pad, tm, first)
    f4, scale_dtype = jnp.float4_e2m1fn, formats.FORMATS[rhs.fmt].scale_dtype
    swizzle = plgpu.find_swizzle(tk * 4)  # 4-bit elements
    transforms = (plgpu.TilingTransform((8, 8 * swizzle // 4)), plgpu.SwizzleTransform(swizzle))
    scratch = dict(
        a_smem=plgpu.SMEM((steps, tm, tk), f4, transforms=transforms),
        b_smem=plgpu.SMEM((steps, tn, tk), f4, transforms=transforms),
        a_sc_smem=plgpu.SMEM((steps, 1, tk // block // 4, 32, 16), scale_dtype),
        b_sc_smem=plgpu.SMEM((steps, 1, tk // block // 4, 32, 16), scale_dtype),
        out_smem=plgpu.SMEM((tm, tn), out_dtype),
        a_sc_tmem=plgpu.TMEM((tm, tk // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        b_sc_tmem=plgpu.TMEM((tn, tk // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        acc_tmem=plgpu.TMEM((tm, tn), jnp.float32),
        tma_barrier=plgpu.Barrier(num_arrivals=4, num_barriers=steps),
        consumed_barrier=plgpu.Barrier(num_arrivals=1, num_barriers=steps, orders_tensor_core=True),
        mma_done_barrier=plgpu.Barrier(orders_tensor_core=True),
    )
    call = plgpu.kernel(
        functools.partial(_kernel, k_iters=k // tk, steps=steps, block=block, tm=tm, tn=tn, tk=tk),
        out_type=metadata.varying_struct((m_pad, n), out_dtype, lhs, rhs, group_sizes, group_offset),
        grid=(sched.group_ids.shape[0], n // tn),
        grid_names=("t", "n"),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
    )
    out = call(
        sched,
        rhs.group_scale,
        x_scale.reshape(1),
        a,
        rhs.values,
        a_sc,
        rhs.scales,
    )
    return sched.zero_foreign_rows(out, g_local, m)
