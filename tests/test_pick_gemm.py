"""pick_gemm, the decode step's expert GEMM by pick: interpreted, against float64 numpy and its XLA
reference; compiled for an H100, one Triton launch per product and nothing sorted or scattered."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import lower, on_h100
from h100_precision import triton_dots
from test_kernels import tolerance

import pallas_kernels as pk
from moejax.compiled import hlo
from moejax.model.layers import silu_glu
from pallas_kernels import tiles
from pallas_kernels.gmm_picks import Tiles, pick_gemm, pick_gemm_xla
from pallas_kernels.layered import LayerOf

EXPERTS, LOCAL, OFFSET = 8, 3, 2  # the local experts [2, 5) of 8: picks of the others come out zero


def tiles_with(**chosen) -> Tiles:
    """The table's default tiles (`tiles.lookup`), but the test's `chosen` ones."""
    return Tiles(**{**tiles.lookup("pick_gemm"), **chosen})


TILES = tiles_with(tn=32, tk=64, tm=16)


def in_rows_dtype(gemm, **fixed):
    """gemm (pick_gemm or its XLA reference) on the local experts [OFFSET, OFFSET + LOCAL), out in
    the rows' dtype, products at full precision; jitted: a second call with a case's shapes
    compiles nothing."""

    @functools.partial(jax.jit, static_argnames=("k", "act", "rows_are_picks"))
    def call(lhs, rhs, ids, columns=None, bias=None, *, k, act=None, rows_are_picks):
        return gemm(
            lhs,
            rhs,
            ids,
            k=k,
            group_offset=OFFSET,
            out_dtype=lhs.dtype,
            epilogue=None if act is None else (columns, bias, act),
            rows_are_picks=rows_are_picks,
            precision="highest",
            **fixed,
        )

    return call


run = in_rows_dtype(pick_gemm, tiles=TILES, interpret=True)
run_xla = in_rows_dtype(pick_gemm_xla)


def draw_picks(rng, tokens: int, k: int) -> np.ndarray:
    """[T * k] int32: each token's k distinct experts of 8; with many tokens local expert 3 is
    in every token's picks, more of them than a chunk's tm rows."""
    hot = [3] if tokens > TILES.tm else []
    rest = [e for e in range(EXPERTS) if e not in hot]
    return np.concatenate([hot + list(rng.choice(rest, k - len(hot), replace=False)) for _ in range(tokens)]).astype(
        np.int32
    )


def numpy_product(lhs, w, ids, k, rows_are_picks, columns=None, bias=None, act=False) -> np.ndarray:
    """float64: out[p] = lhs[row(p)] @ w[ids[p] - OFFSET] * columns + bias, through silu(gate) * up
    over (gate, up) column pairs with act; zero for picks of experts not local."""
    lhs, w = np.asarray(lhs, np.float64), np.asarray(w, np.float64)
    out = np.zeros((ids.shape[0], w.shape[2]))
    for p, e in enumerate(ids):
        if OFFSET <= e < OFFSET + LOCAL:
            g = e - OFFSET
            y = lhs[p if rows_are_picks else p // k] @ w[g]
            y = y if columns is None else y * np.asarray(columns[g], np.float64)
            out[p] = y if bias is None else y + np.asarray(bias[g], np.float64)
    if act:
        gate, up = out[:, 0::2], out[:, 1::2]
        return np.where(np.isin(ids, range(OFFSET, OFFSET + LOCAL))[:, None], gate / (1 + np.exp(-gate)) * up, 0.0)
    return out


def weights(rng, fmt: str, dtype, k: int, n: int, gated: bool, layers: int | None = None):
    """The local experts [LOCAL, K, N] (a stack [layers, LOCAL, K, N]: each layer its own scale) as
    pick_gemm takes them and their exact f32 values. A 4-bit gate|up stack keeps a tensor scale
    per half (column-wise), gate and up drawn 40x apart so that each must be its own."""
    lead = () if layers is None else (layers,)
    w = rng.standard_normal((*lead, LOCAL, k, n)) / np.sqrt(k)
    w = w * (np.arange(layers) + 1.0)[:, None, None, None] if layers else w
    w = jnp.asarray(w * np.array([1.0, 40.0] * (n // 2)) if gated else w, jnp.float32)
    if fmt == "dense":
        return w.astype(dtype), w.astype(dtype).astype(jnp.float32)
    q = pk.quantize_experts(w, fmt, gated=gated)
    return q, pk.dequantize(q)


# (format, dtype, product, K, N, tokens, k): each format, dtype and product; 8 picks (a token's)
# and 64 (32 tokens' two, expert 3 in each: the chunk loop); K and N no tile divides (K 40 in a
# masked tile of 64, N 24 in one of 32; NVFP4 K 96: K-halves of 48 in a tile of 32 and a masked
# one; gate|up N 48: 24 (gate, up) pairs in a tile of 16 and a masked one).
CASES = [
    ("dense", jnp.bfloat16, "gate_up", 64, 64, 1, 8),
    ("dense", jnp.float32, "down", 40, 24, 32, 2),
    ("nvfp4", jnp.float32, "gate_up", 96, 48, 32, 2),
    ("mxfp4", jnp.bfloat16, "down", 64, 40, 1, 8),
]
IDS = [f"{f}-{jnp.dtype(d).name}-{p}-K{k}-N{n}-P{t * kk}" for f, d, p, k, n, t, kk in CASES]


@dataclasses.dataclass(frozen=True)
class Case:
    """A case's operands (ids as numpy), run's keyword arguments, and its products: pick_gemm's, the
    XLA reference's and numpy's float64 one."""

    lhs: jax.Array
    w: object
    ids: np.ndarray
    args: dict
    out: np.ndarray
    reference: np.ndarray
    expected: np.ndarray


@functools.cache
def case(fmt, dtype, product, k, n, tokens, picks_per_token) -> Case:
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{product}/{k}/{n}/{tokens}".encode()))
    ids = draw_picks(rng, tokens, picks_per_token)
    gated = product == "gate_up"
    lhs = jnp.asarray(rng.standard_normal((tokens if gated else ids.shape[0], k)), dtype)
    w, w_f32 = weights(rng, fmt, dtype, k, n, gated)
    # gate|up: column scales (dense experts; 4-bit ones carry their own) and a bias [LOCAL, N]
    columns = jnp.asarray(rng.uniform(0.5, 2.0, (LOCAL, n)), dtype) if gated and fmt == "dense" else None
    bias = jnp.asarray(rng.standard_normal((LOCAL, n)), dtype) if gated else None
    args = dict(
        columns=columns, bias=bias, k=picks_per_token, act=silu_glu if gated else None, rows_are_picks=not gated
    )
    return Case(
        lhs,
        w,
        ids,
        args,
        np.asarray(run(lhs, w, jnp.asarray(ids), **args), np.float32),
        np.asarray(run_xla(lhs, w, jnp.asarray(ids), **args), np.float32),
        numpy_product(lhs, w_f32, ids, picks_per_token, not gated, columns, bias, gated),
    )


def numpy_tolerance(dtype) -> dict:
    """float64 numpy against float32 products (bf16: as against the XLA path)."""
    return tolerance(dtype) if dtype == jnp.bfloat16 else dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,dtype,product,k,n,tokens,picks_per_token", CASES, ids=IDS)
def test_kernel_matches_numpy_and_the_xla_reference(fmt, dtype, product, k, n, tokens, picks_per_token):
    c = case(fmt, dtype, product, k, n, tokens, picks_per_token)
    assert c.out.shape == (c.ids.shape[0], n // 2 if product == "gate_up" else n)
    if tokens > TILES.tm:  # an expert with more picks than a chunk's rows: the chunk loop
        assert np.bincount(c.ids).max() > TILES.tm
    np.testing.assert_allclose(c.out, c.expected, **numpy_tolerance(dtype))
    np.testing.assert_allclose(c.out, c.reference, **tolerance(dtype))


@pytest.mark.parametrize("fmt,dtype,product,k,n,tokens,picks_per_token", CASES, ids=IDS)
def test_xla_reference_matches_numpy(fmt, dtype, product, k, n, tokens, picks_per_token):
    c = case(fmt, dtype, product, k, n, tokens, picks_per_token)
    np.testing.assert_allclose(c.reference, c.expected, **numpy_tolerance(dtype))


@pytest.mark.parametrize("fmt,dtype,product,k,n,tokens,picks_per_token", CASES, ids=IDS)
def test_picks_of_other_experts_come_out_zero(fmt, dtype, product, k, n, tokens, picks_per_token):
    """Experts outside [OFFSET, OFFSET + LOCAL) are another device's: their picks' rows are zeros
    (written: interpret mode starts the output as NaN), the local experts' are not."""
    c = case(fmt, dtype, product, k, n, tokens, picks_per_token)
    local = (c.ids >= OFFSET) & (c.ids < OFFSET + LOCAL)
    assert local.any() and not local.all()
    np.testing.assert_array_equal(c.out[~local], 0.0)
    assert np.all(np.abs(c.out[local]).max(axis=1) > 0)


@pytest.mark.parametrize("product", ["gate_up", "down"])
def test_reads_one_layer_of_a_stack(product):
    """Layer 1 of a 3-layer NVFP4 stack (`LayerOf`: the stack read where it lies), each layer's
    weights and tensor scales (gate|up: one per column; down: one per expert) its own: layer 1's
    product."""
    fmt = "nvfp4"
    rng = np.random.default_rng(zlib.crc32(f"stack/{fmt}".encode()))
    gated, k, n, tokens, picks_per_token = product == "gate_up", 64, 64, 8, 8
    ids = draw_picks(rng, tokens, picks_per_token)
    lhs = jnp.asarray(rng.standard_normal((tokens if gated else ids.shape[0], k)), jnp.float32)
    stack, stack_f32 = weights(rng, fmt, jnp.float32, k, n, gated, layers=3)
    args = dict(k=picks_per_token, act=silu_glu if gated else None, rows_are_picks=not gated)
    out = run(lhs, LayerOf(stack, jnp.int32(1)), jnp.asarray(ids), **args)
    expected = numpy_product(lhs, stack_f32[1], ids, picks_per_token, not gated, act=gated)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(ids=jnp.zeros(8, jnp.float32)), "ids \\[P\\] int32"),
        (dict(ids=jnp.zeros((1, 8), jnp.int32)), "ids \\[P\\] int32"),
        (dict(lhs=jnp.zeros((1024, 64)), ids=jnp.zeros(8192, jnp.int32)), "at most 4096 picks"),
        (dict(lhs=jnp.zeros((2, 64))), "lhs must be \\[P / k, K\\]"),
        (dict(rhs=jnp.zeros((3, 32, 48))), "rhs must be \\[G, K=64, N\\]"),
        (dict(rhs=jnp.zeros((3, 64, 47)), epilogue=(None, None, silu_glu)), "column pairs"),
        (dict(tiles=tiles_with(tm=8)), "tiles.tm=8 must be a power of two of at least 16"),
        (dict(tiles=tiles_with(tk=48)), "tiles.tk=48"),
        (
            dict(rhs=pk.quantize_experts(jnp.zeros((3, 64, 48)), "mxfp4"), tiles=tiles_with(tk=32)),
            "tiles.tk=32 .* at least 64",
        ),
    ],
)
def test_bad_input_gets_one_clear_error(change, message):
    args = {"lhs": jnp.zeros((1, 64)), "rhs": jnp.zeros((3, 64, 48)), "ids": jnp.zeros(8, jnp.int32), "tiles": TILES}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        pick_gemm(args.pop("lhs"), args.pop("rhs"), args.pop("ids"), k=8, group_offset=0, out_dtype=jnp.float32, **args)


# A Qwen3-MoE shaped layer, small: 16 experts of D = 256, F = 128, k = 8; each layer of a 2-layer stack.
E, D, F, K = 16, 256, 128, 8


@functools.cache
def h100_moe(fmt: str, tokens: int):
    """A layer's two products (gate|up with SwiGLU and a bias, then down) through pick_gemm on one
    layer of a stack, lowered and compiled for a compile-only H100; the stacks' abstract leaves."""
    dtype = jnp.float32 if fmt == "f32" else jnp.bfloat16
    up, down = jax.ShapeDtypeStruct((2, E, D, 2 * F), dtype), jax.ShapeDtypeStruct((2, E, F, D), dtype)
    if fmt in pk.FORMATS:
        up = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt, gated=True), up)
        down = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt), down)
    up, down = (jax.tree.map(lambda a: on_h100(a.shape, a.dtype), w) for w in (up, down))
    precision = "highest" if fmt == "f32" else None

    def moe(x, ids, up, down, bias, layer):
        common = dict(k=K, group_offset=0, out_dtype=x.dtype, tiles=tiles_with(tn=64, tk=128), precision=precision)
        h = pick_gemm(x, LayerOf(up, layer), ids, epilogue=(None, bias, silu_glu), **common)  # [T*k, F]
        return pick_gemm(h, LayerOf(down, layer), ids, rows_are_picks=True, **common)  # [T*k, D]

    lowered = lower(
        jax.jit(moe),
        on_h100((tokens, D), dtype),
        on_h100((tokens * K,), jnp.int32),
        up,
        down,
        on_h100((E, 2 * F), dtype),
        on_h100((), jnp.int32),
    )
    return lowered, lowered.compile().as_text(), (up, down)


H100_CASES = [("bf16", 64), ("nvfp4", 1), ("mxfp4", 64), ("f32", 1)]


@pytest.mark.parametrize("fmt,tokens", H100_CASES)
def test_compiles_for_h100_as_one_launch_per_product(fmt, tokens):
    """Compiled for an H100 at batch 1 and 64 (8 and 512 picks): each product is one Triton
    custom call; nothing sorts or scatters the picks; every other instruction that runs writes a
    scalar (a stack's layer index times its experts); none writes an array of a layer's shape
    (a layer copied out of its stack)."""
    _, text, stacks = h100_moe(fmt, tokens)
    launched = [r.instr for r in hlo.launches(text)]
    assert [i.pallas for i in launched if i.opcode == "custom-call"] == ["triton"] * 2
    assert not [i for i in hlo.parse(text).instrs if i.opcode in ("sort", "scatter")]  # fused ones included
    assert hlo.writes_of(text, [a.shape[1:] for a in jax.tree.leaves(stacks)], ordered=True) == []
    assert all(i.dtypes == ["s32"] and i.shapes in ([()], [(1,)]) for i in launched if i.opcode != "custom-call")


def test_f32_products_are_full_precision_on_h100():
    """precision "highest": Triton multiplies float32 as float32 ("ieee", its IR's unprinted
    default), not TF32."""
    lowered, _, _ = h100_moe("f32", 1)
    dots = triton_dots(lowered)
    assert dots and all("xf32>" in d and "tf32" not in d for d in dots)
