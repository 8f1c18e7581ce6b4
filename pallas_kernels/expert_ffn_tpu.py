"""A decode step's experts as one Mosaic TPU kernel: gate|up, the gated activation, down and the
weighted sum of each row's picks, by expert, with no sort and no group metadata.

A decode step has a few rows, each picking k of the experts, and one TPU core runs a program's
ops one after another: the grouped GEMM's path (sort the picks, group sizes, megablox's metadata,
two GEMMs, un-sort, the weighted sum) is some sixty ops a layer. Here the grid walks the local
experts g and, within each, F tiles f of the intermediate width. Step (g, f) multiplies every row
x [T, D] by expert g's gate|up columns of tile f ([D, 2tf]), takes act(gate, up) [T, tf], and adds
its product with the down rows of tile f ([tf, D]) to the expert's [T, D] f32 sum; the last tile
rounds that sum to the rows' dtype (where the two-product path rounds each pick's down product),
weighs each row by its weight for g (zero for a row that did not pick it) and adds it to the
output. Rows that did not pick g cost MXU work, not bytes: at decode sizes a step is bound by the
weights it streams.

An expert no row picked is never read: the scalar-prefetched `slot` [G_local] maps it to the
tiles the pipeline already holds (the last tile of the expert before it, or the first of the
first picked one), so its steps fetch nothing, and they skip their math. A layer of a run's stack
(`layered.LayerOf`) is read where it lies, its first group prefetched.

gate|up interleaves gate and up along N (`epilogue`): a [T, 2tf] product becomes [gate | up] by
one product with a 0/1 permutation [2tf, 2tf] at full precision (exact: each output is one input
times 1), since Mosaic has no lane-strided load.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import epilogue, layered, metadata, tiling


@dataclasses.dataclass(frozen=True)
class Tiles:
    """tn: gate|up columns a step takes ([D, tn], tn / 2 (gate, up) pairs; down [tn / 2, D]), a whole
    number of 128-lane blocks dividing 2F (`tiles.lookup("expert_ffn_tpu", ..)` of the gate|up stack)."""

    tn: int


def shape_refusal(k: int, n: int, gated: bool, tiles: Tiles) -> str | None:
    """Why experts whose gate|up matrix is [K, N] (`gated`; the down matrix [N/2, K] follows) cannot
    be tiled by `tiles`, or None."""
    if gated and (n % tiles.tn or tiles.tn % 128):
        return f"a gate|up width of {n} is no whole number of {tiles.tn}-column tiles of 128 lanes"
    return None


def _permutation(width: int) -> jax.Array:
    """[width, width] f32: y @ P puts y's even columns first, its odd ones after them."""
    row = lax.broadcasted_iota(jnp.int32, (width, width), 0)
    col = lax.broadcasted_iota(jnp.int32, (width, width), 1)
    half = width // 2
    return (row == jnp.where(col < half, 2 * col, 2 * (col - half) + 1)).astype(jnp.float32)


def _kernel(
    slot, offset, layer_gu, layer_d, x_ref, ids_ref, w_ref, gu_ref, d_ref, *refs, tiles_f, act, cdtype, precision
):
    """Step (g, f). Refs: x [T, D], ids and weights [T, k], expert g's gate|up tile [D, 2tf] and down
    tile [tf, D], the biases' ([1, 2tf], [1, D]) where given, out [T, D], the f32 scratches: the
    output's sum and expert g's [T, D]."""
    *biases, out_ref, acc_ref, expert_ref = refs
    gu_bias, d_bias = biases if biases else (None, None)
    g, f = pl.program_id(0), pl.program_id(1)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    @pl.when((g == 0) & (f == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(slot[g] == g)  # a picked expert
    def _():
        @pl.when(f == 0)
        def _():
            expert_ref[...] = jnp.zeros_like(expert_ref)

        y = dot(x_ref[...].astype(cdtype), gu_ref[...].astype(cdtype))  # [T, 2tf]
        y = epilogue.finish(y, x_ref.dtype, None, None if gu_bias is None else gu_bias[...])
        both = dot(y.astype(jnp.float32), _permutation(y.shape[1]), precision=lax.Precision.HIGHEST)
        half = y.shape[1] // 2
        h = epilogue.glu(both[:, :half].astype(y.dtype), both[:, half:].astype(y.dtype), act)  # [T, tf]
        expert_ref[...] += dot(h.astype(cdtype), d_ref[...].astype(cdtype))

        @pl.when(f == tiles_f - 1)
        def _():
            y = epilogue.finish(expert_ref[...], x_ref.dtype, None, None if d_bias is None else d_bias[...])
            picked = ids_ref[...] == g + offset[0]  # [T, k]: at most one pick a row
            weight = jnp.sum(jnp.where(picked, w_ref[...], 0.0), axis=1, keepdims=True)  # [T, 1]
            acc_ref[...] += y.astype(jnp.float32) * weight

    @pl.when((g == pl.num_programs(0) - 1) & (f == tiles_f - 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def expert_slots(ids: jax.Array, group_offset, g_local: int) -> jax.Array:
    """ids [T, k] -> slot [G_local] int32: g for an expert some row picked; else the picked expert
    whose tiles the pipeline holds when g's steps come (the last picked one before g, or the first
    picked one), so that they fetch nothing. No pick among the local experts: all 0 (expert 0's steps
    run, weighing every row 0)."""
    local = ids.reshape(-1) - group_offset  # [P] the picks' local experts
    mine = (local >= 0) & (local < g_local)
    g = jnp.arange(g_local, dtype=jnp.int32)[:, None]
    # Two reductions of one [G_local, P] comparison, which XLA fuses: a scan over experts would be ops of its own.
    before = jnp.max(jnp.where(mine & (local <= g), local, -1), axis=1)  # [G_local]
    first = jnp.min(jnp.where(mine, local, g_local))
    return jnp.where(before >= 0, before, jnp.where(first < g_local, first, 0)).astype(jnp.int32)


def expert_ffn_tpu(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    gate_up,
    down,
    *,
    group_offset=0,
    act,
    gate_up_bias: jax.Array | None = None,
    down_bias: jax.Array | None = None,
    slot: jax.Array | None = None,
    tiles: Tiles,
    precision=None,
    interpret: bool = False,
) -> jax.Array:
    """x [T, D], ids int32 and weights f32 [T, k] (picks of global experts) -> [T, D] in x's dtype:
    sum over each row's picks of weight * down(act(gate, up)) through the local experts [offset,
    offset + G_local) of gate_up [G_local, D, 2F] and down [G_local, F, D] (arrays, or LayerOf either);
    picks of other experts add nothing. Biases: [G_local, 2F] and [G_local, D]. slot [G_local]:
    `expert_slots` of the picks where the caller has it (the router kernel writes it), else built
    here. precision: the products' matmul precision (the run's: "highest" for float32)."""
    t, d = x.shape
    g_local, _, f2 = gate_up.shape
    tf = tiles.tn // 2
    reason = shape_refusal(d, f2, True, tiles)
    if reason:
        raise ValueError(f"expert_ffn_tpu: {reason}")
    offset = jnp.asarray(group_offset, jnp.int32).reshape(1)
    slot = expert_slots(ids, offset[0], g_local) if slot is None else slot
    # The layers' experts as one axis [L * G_local, ...] (a bitcast), each map finding layer * G_local + e
    # (`layered.flat`'s first group, multiplied out of the kernel, is an op of its own).
    (gu, layer_gu), (dn, layer_d) = layered.stacked(gate_up), layered.stacked(down)
    gu, dn = (a.reshape(-1, *a.shape[2:]) for a in (gu, dn))
    tiles_f = f2 // 2 // tf

    def step(g, f, slot):
        """Expert g's weights and F tile at step (g, f): its own, or those the pipeline holds."""
        mine = slot[g] == g
        return slot[g], jnp.where(mine, f, jnp.where(slot[g] < g, tiles_f - 1, 0))

    def gu_map(g, f, slot, offset, layer_gu, layer_d):
        e, tile = step(g, f, slot)
        return layer_gu[0] * g_local + e, 0, tile

    def d_map(g, f, slot, offset, layer_gu, layer_d):
        e, tile = step(g, f, slot)
        return layer_d[0] * g_local + e, tile, 0

    def gu_bias_map(g, f, slot, *_):  # a layer's own biases [G_local, 1, N]: no first group
        e, tile = step(g, f, slot)
        return e, 0, tile

    def d_bias_map(g, f, slot, *_):
        e, _ = step(g, f, slot)
        return e, 0, 0

    whole = pl.BlockSpec(memory_space=pltpu.VMEM)  # the array, in VMEM for the whole call
    in_specs = [
        whole,
        whole,
        whole,
        pl.BlockSpec((None, d, 2 * tf), gu_map),
        pl.BlockSpec((None, tf, d), d_map),
    ]
    operands = [x, ids, weights.astype(jnp.float32), gu, dn]
    if gate_up_bias is not None or down_bias is not None:
        gu_b = jnp.zeros((g_local, f2), x.dtype) if gate_up_bias is None else gate_up_bias
        d_b = jnp.zeros((g_local, d), x.dtype) if down_bias is None else down_bias
        operands += [gu_b.reshape(g_local, 1, f2), d_b.reshape(g_local, 1, d)]
        in_specs += [pl.BlockSpec((None, 1, 2 * tf), gu_bias_map), pl.BlockSpec((None, 1, d), d_bias_map)]
    kernel = functools.partial(
        _kernel,
        tiles_f=tiles_f,
        act=act,
        cdtype=tiling.compute_dtype(x.dtype, gu),
        precision=precision,
    )
    # VMEM: the weight tiles and biases twice over (the pipeline fetches the next step's during this
    # one's), the rows, picks and output once each side, the two [T, D] f32 sums; and room for the
    # step's temporaries. A wide model's tiles outgrow Mosaic's default scoped limit (16 MiB on v5e).
    tile_bytes = (d * 2 * tf + tf * d) * gu.dtype.itemsize + (2 * tf + d) * x.dtype.itemsize
    row_bytes = 2 * t * d * x.dtype.itemsize + 2 * ids.size * 4
    vmem = 2 * (tile_bytes + row_bytes) + 3 * t * d * 4 + t * 2 * tf * 4 * 4 + (4 << 20)
    layer_bytes = sum(a.size * a.dtype.itemsize // (a.shape[0] // g_local) for a in (gu, dn))
    return pl.pallas_call(
        kernel,
        out_shape=metadata.varying_struct((t, d), x.dtype, x, ids, gu, dn),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            in_specs=in_specs,
            out_specs=whole,
            grid=(g_local, tiles_f),
            scratch_shapes=[pltpu.VMEM((t, d), jnp.float32), pltpu.VMEM((t, d), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=max(vmem, 16 << 20)
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * t * d * (f2 + f2 // 2) * g_local,
            transcendentals=t * f2 // 2 * g_local,
            bytes_accessed=2 * x.size * x.dtype.itemsize + layer_bytes,
        ),
    )(slot, offset, layer_gu, layer_d, *operands)
