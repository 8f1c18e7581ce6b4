"""The decode step's pick GEMM on Mosaic GPU (`gmm_picks_mgpu`) without a GPU: jax's Mosaic GPU
interpreter runs it against float64 numpy and `pick_gemm_xla`; jax's Mosaic GPU lowering and XLA:GPU
compile it for a compile-only H100 at Qwen3-30B-A3B's shapes. Its PTX is run only on a GPU."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on_h100

import pallas_kernels as pk
from moejax.base import targets
from moejax.compiled import hlo
from moejax.model.layers import silu_glu
from pallas_kernels import gmm_picks_mgpu, tiles
from pallas_kernels.gmm_mosaic_gpu import InterpretGPUParams, Tiles
from pallas_kernels.gmm_picks import pick_gemm_xla
from pallas_kernels.layered import LayerOf

# 3 tokens' 2 picks over 5 local experts [2, 7): one pick (9) another device's, one (0) before the
# local ones, expert 4 picked twice, experts 3 and 6 never; K and N no tile divides.
T, K_PICKS, LOCAL, OFFSET, K, N = 3, 2, 5, 2, 200, 72
IDS = np.array([2, 4, 9, 5, 4, 0], np.int32)


def choose(rows: int, k: int, n: int, fmt: str = "bf16", gated: bool = False, on=None) -> Tiles:
    """The table's tiles for lhs [rows, K] times experts [K, N]; `on`: (target, picks, experts),
    narrowed to fill the target's SMs as the picks' active CTAs would (`tiles.lookup`)."""
    narrow = {}
    if on is not None:
        target, picks, experts = on
        touched, floor = min(picks, experts), gmm_picks_mgpu.TN_FLOORS[gated]
        device = (targets.TARGETS[target].device_kind, targets.TARGETS[target].cores)
        narrow = dict(device=device, programs=lambda tn, _: touched * -(-n // tn), tn_floor=floor)
    return Tiles(**tiles.lookup("pick_gemm_mgpu", rows=rows, k=k, n=n, fmt=fmt, gated=gated, **narrow))


def run(lhs, w, ids, *, rows_are_picks=False, epilogue=None, out_dtype=jnp.bfloat16, tn=None) -> np.ndarray:
    """The interpreted kernel's product (group offset and any layer index traced), as float64; tn:
    the N tile, else the table's."""
    fmt = getattr(w.stack if isinstance(w, LayerOf) else w, "fmt", "bf16")
    chosen = choose(lhs.shape[0], lhs.shape[1], w.shape[2], fmt, epilogue is not None and epilogue[2] is not None)
    chosen = chosen if tn is None else dataclasses.replace(chosen, tn=tn)
    f = jax.jit(
        lambda lhs, w, ids, offset, tables: gmm_picks_mgpu.pick_gemm(
            lhs,
            w,
            ids,
            k=K_PICKS,
            group_offset=offset,
            out_dtype=out_dtype,
            epilogue=tables and (*tables, epilogue[2]),
            rows_are_picks=rows_are_picks,
            tiles=chosen,
            interpret=True,
        )
    )
    return np.asarray(f(lhs, w, jnp.asarray(ids), jnp.int32(OFFSET), epilogue and epilogue[:2]), np.float64)


def expected(lhs, w, ids, rows_are_picks=False, columns=None, bias=None, act=False) -> np.ndarray:
    """float64: out[p] = lhs[row(p)] @ w[ids[p] - OFFSET] * columns + bias (silu(gate) * up over the
    (gate, up) column pairs with act); zero for picks of experts not local."""
    x, w = np.asarray(lhs, np.float64), np.asarray(w, np.float64)
    out = np.zeros((ids.shape[0], w.shape[2]))
    for p, e in enumerate(ids):
        if OFFSET <= e < OFFSET + LOCAL:
            g = e - OFFSET
            y = x[p if rows_are_picks else p // K_PICKS] @ w[g]
            y = y if columns is None else y * np.asarray(columns[g], np.float64)
            out[p] = y if bias is None else y + np.asarray(bias[g], np.float64)
    if not act:
        return out
    gate, up = out[:, 0::2], out[:, 1::2]
    return gate / (1 + np.exp(-gate)) * up


def assert_matches(out: np.ndarray, want: np.ndarray, ids: np.ndarray) -> None:
    """Within bf16's rounding of the largest value; the picks of experts not local exactly 0."""
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    foreign = (ids < OFFSET) | (ids >= OFFSET + LOCAL)
    assert foreign.any() and not foreign.all()
    np.testing.assert_array_equal(out[foreign], 0.0)


def operands(name: str, rows: int, k: int = K, n: int = N, layers: int | None = None):
    """(lhs [rows, K] bf16, experts [(layers,) LOCAL, K, N] f32) drawn for test `name`."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    lead = () if layers is None else (layers,)
    lhs = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    return lhs, jnp.asarray(rng.standard_normal((*lead, LOCAL, k, n)) / np.sqrt(k), jnp.float32), rng


def test_bf16_experts_match_float64_and_the_xla_reference():
    lhs, w, _ = operands("bf16", T)
    w = w.astype(jnp.bfloat16)
    out = run(lhs, w, IDS)
    assert_matches(out, expected(lhs, w, IDS), IDS)
    xla = pick_gemm_xla(lhs, w, jnp.asarray(IDS), k=K_PICKS, group_offset=OFFSET, out_dtype=jnp.bfloat16)
    np.testing.assert_allclose(out, np.asarray(xla, np.float64), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tn", [None, 64])
def test_column_scales_bias_and_gated_act_over_gate_up_pairs(tn):
    """The table's N tile, and the fill rule's floor of 32 (gate, up) pairs: 64-byte output rows,
    stored from rows 128 bytes apart (N = 36 pairs: a whole tile and an edge one)."""
    lhs, w, rng = operands("act", T)
    w = w.astype(jnp.bfloat16)
    columns = jnp.asarray(rng.uniform(0.5, 2.0, (LOCAL, N)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((LOCAL, N)), jnp.bfloat16)
    out = run(lhs, w, IDS, epilogue=(columns, bias, silu_glu), tn=tn)
    assert out.shape == (IDS.shape[0], N // 2)
    assert_matches(out, expected(lhs, w, IDS, columns=columns, bias=bias, act=True), IDS)


def test_a_layer_of_a_stack_is_read_in_place():
    lhs, stack, _ = operands("layer", T, layers=3)
    stack = stack.astype(jnp.bfloat16)
    out = run(lhs, LayerOf(stack, jnp.int32(1)), IDS)
    assert_matches(out, expected(lhs, stack[1], IDS), IDS)


def test_fewer_picks_than_experts_each_expert_led_by_its_first_pick():
    """4 picks of 5 local experts: a row of CTAs per pick, pick 0 leading expert 4's two picks (pick
    2's CTA exits), pick 1 another device's expert, pick 3 the first local expert."""
    ids = np.array([6, 0, 6, 2], np.int32)
    lhs, w, _ = operands("by pick", 2)
    w = w.astype(jnp.bfloat16)
    assert_matches(run(lhs, w, ids), expected(lhs, w, ids), ids)


def test_rows_and_ids_read_past_their_ends_and_other_devices_picks_written_where_memory_starts_nan(monkeypatch):
    """Where the interpreter's fresh memory and reads past an array are NaN (ints: their largest),
    not zero: the rows past the lhs's and the ids past P read garbage (a row tile's products are
    row by row; the picks past P are masked), and the picks of other devices' experts are zero
    where no select follows: CTA (s, j) writes pick s's zero row with fewer picks than local
    experts. K a whole number of K tiles: past K no garbage may enter the sums."""
    nan = InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
    monkeypatch.setattr(gmm_picks_mgpu, "interpret_params", lambda interpret: nan)
    ids = np.array([6, 0, 6, 2], np.int32)
    lhs, w, _ = operands("nan", 2, k=256)
    w = w.astype(jnp.bfloat16)
    out = run(lhs, w, ids)
    assert np.isfinite(out).all()
    assert_matches(out, expected(lhs, w, ids), ids)


def test_down_rows_over_two_row_tiles():
    """A down product of 160 picks (rows): row tiles of 128; expert 4 has picks in both (its weights
    read once per tile) and several in one (a store per pick)."""
    rng = np.random.default_rng(7)
    ids = rng.choice([0, 2, 3, 4, 5, 6, 9], 160).astype(np.int32)
    ids[[5, 6, 150]] = 4
    lhs, w, _ = operands("down", 160, k=K, n=N)
    w = w.astype(jnp.bfloat16)
    assert choose(160, K, N).tm == 128
    out = run(lhs, w, ids, rows_are_picks=True)
    assert_matches(out, expected(lhs, w, ids, rows_are_picks=True), ids)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_4bit_gate_up_experts_decoded_in_the_kernel(fmt):
    """A 4-bit gate|up stack (NVFP4: a tensor scale per half, gate and up 40x apart) with a bias and
    the gated act, K 192 (K-halves of 96: a full 64-value step and a zero-padded one)."""
    lhs, w, rng = operands(fmt, T, k=192)
    w = w * np.array([1.0, 40.0] * (N // 2))
    q = pk.quantize_experts(w, fmt, gated=True)
    bias = jnp.asarray(rng.standard_normal((LOCAL, N)), jnp.bfloat16)
    out = run(lhs, q, IDS, epilogue=(None, bias, silu_glu))
    assert_matches(out, expected(lhs, pk.dequantize(q), IDS, bias=bias, act=True), IDS)


def test_refuses_float32_rows_with_its_reason():
    lhs, w, _ = operands("f32", T)
    with pytest.raises(ValueError, match="TF32"):
        run(lhs.astype(jnp.float32), w, IDS, out_dtype=jnp.float32)


def test_an_nvfp4_gate_up_layer_takes_its_own_layers_column_scales():
    """A layer of a 4-bit gate|up stack: the weights read in place, the tensor scales (per half and
    layer, each layer's 40x the last's) sliced at the traced layer."""
    lhs, w, rng = operands("nvfp4 layer", T, k=192, layers=2)
    w = w * np.array([1.0, 40.0] * (N // 2)) * np.array([1.0, 40.0])[:, None, None, None]
    q = pk.quantize_experts(w, "nvfp4", gated=True)
    bias = jnp.asarray(rng.standard_normal((LOCAL, N)), jnp.bfloat16)
    out = run(lhs, LayerOf(q, jnp.int32(1)), IDS, epilogue=(None, bias, silu_glu))
    assert_matches(out, expected(lhs, pk.dequantize(q)[1], IDS, bias=bias, act=True), IDS)


def qwen3_step(tokens: int, fmt: str = "bf16"):
    """The compiled program of Qwen3-30B-A3B's two expert products by pick on a compile-only H100
    (128 experts, [2048, 1536] gate|up with SwiGLU, one layer of a stack of 4, and [768, 2048] down;
    8 picks a token), with the tiles the table gives them there -> (its launches, its Pallas calls)."""
    p = tokens * 8

    def experts(k: int, n: int, gated: bool, lead=()):
        w = jax.ShapeDtypeStruct((*lead, 128, k, n), jnp.bfloat16)
        if fmt != "bf16":
            w = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt, gated=gated), w)
        return jax.tree.map(lambda a: on_h100(a.shape, a.dtype), w)

    def step(x, ids, offset, layer, gate_up, down):
        h = gmm_picks_mgpu.pick_gemm(
            x,
            LayerOf(gate_up, layer),
            ids,
            k=8,
            group_offset=offset,
            out_dtype=jnp.bfloat16,
            epilogue=(None, None, silu_glu),
            tiles=choose(tokens, 2048, 1536, fmt, gated=True, on=("h100", p, 128)),
        )  # [P, 768]
        return gmm_picks_mgpu.pick_gemm(
            h,
            down,
            ids,
            k=8,
            group_offset=offset,
            out_dtype=jnp.bfloat16,
            rows_are_picks=True,
            tiles=choose(p, 768, 2048, fmt, on=("h100", p, 128)),
        )  # [P, 2048]

    scalar = on_h100((), jnp.int32)
    x, ids = on_h100((tokens, 2048), jnp.bfloat16), on_h100((p,), jnp.int32)
    text = jax.jit(step).lower(x, ids, scalar, scalar, experts(2048, 1536, True, (4,)), experts(768, 2048, False))
    launches = hlo.launches(text.compile().as_text())
    return launches, [r.instr for r in launches if r.instr.pallas]


def assert_one_mosaic_gpu_call_per_product(launches, calls) -> None:
    """Two Mosaic GPU calls of this kernel, each a bf16 wgmma, and no Triton call among the launches."""
    assert launches and not [r for r in launches if r.instr.pallas == "triton" or "triton" in r.instr.target]
    assert [(c.pallas, c.kernel) for c in calls] == [("mosaic_gpu", gmm_picks_mgpu.NAME)] * 2
    assert all(".f32.bf16.bf16" in c.backend_config for c in calls)


def assert_no_pad_and_selects(launches, selects: int) -> None:
    """The kernels read the ids and rows unpadded: no XLA pad among the launches; `selects` XLA
    selects zero other devices' picks (none where the kernel writes them: fewer picks than experts)."""
    xla = [r.instr.scope.rsplit("/", 1)[-1] for r in launches if not r.instr.pallas]
    assert len(xla) < len(launches) and not [op for op in xla if "pad" in op]
    assert xla.count("select_n") == selects


@pytest.mark.parametrize("tokens", [1, 64])
def test_compiles_for_h100_as_one_mosaic_gpu_call_per_product(tokens):
    launches, calls = qwen3_step(tokens)
    assert_one_mosaic_gpu_call_per_product(launches, calls)
    assert_no_pad_and_selects(launches, 0 if tokens == 1 else 2)  # 8 picks of 128 experts, or 512
    # a row of CTAs per pick (8 picks) or per expert (512 picks of 128), one CTA per N tile: where 8
    # rows of them leave the SMs short of two each, 32 (gate, up) pairs and 64 columns, else 64 and 128
    rows, narrow = min(8 * tokens, 128), 2 if tokens == 1 else 1
    assert [c.programs for c in calls] == [rows * 1536 * narrow // 128, rows * 2048 * narrow // 128]


def test_nvfp4_experts_compile_for_h100_as_one_mosaic_gpu_call_per_product():
    launches, calls = qwen3_step(1, "nvfp4")
    assert_one_mosaic_gpu_call_per_product(launches, calls)
    assert_no_pad_and_selects(launches, 0)


def test_expert_slices_of_k_96_compile_for_h100():
    """tensor_sliced's Qwen3-30B-A3B down slices over 8 devices, K = 96: three 32-column tiles (64-byte
    swizzle), which the kernel takes; K = 80 it refuses."""
    p = 8
    tiles = choose(p, 96, 2048, on=("h100", p, 128))
    x, w, ids = on_h100((p, 96), jnp.bfloat16), on_h100((128, 96, 2048), jnp.bfloat16), on_h100((p,), jnp.int32)
    f = lambda x, w, ids: gmm_picks_mgpu.pick_gemm(  # noqa: E731
        x, w, ids, k=8, group_offset=0, out_dtype=jnp.bfloat16, rows_are_picks=True, tiles=tiles
    )
    calls = [r.instr for r in hlo.launches(jax.jit(f).lower(x, w, ids).compile().as_text()) if r.instr.pallas]
    assert [(c.pallas, c.kernel) for c in calls] == [("mosaic_gpu", gmm_picks_mgpu.NAME)]
    assert gmm_picks_mgpu.shape_refusal(96, 2048, False, tiles) is None
    assert "got K=80" in gmm_picks_mgpu.shape_refusal(80, 2048, False, tiles)
