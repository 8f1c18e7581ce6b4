"""The TPU dense kernel (`linear_tpu.fused_linear`): interpreted against float64 numpy at widths no
block divides (K 200, heads of 72 with a rotated half of 24), each epilogue, its weights in their
model's shapes and in their run's stacks; refusals; compiled for a v5e at Qwen3-30B-A3B's widths,
one Mosaic call reading the layer in its stack."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on

from moejax.compiled import hlo
from pallas_kernels import catalog, tiles
from pallas_kernels.layered import LayerOf
from pallas_kernels.linear_tpu import Tiles, fused_linear

M, K, H, DH, HALF, EPS = 3, 200, 16, 72, 24, 1e-6
TILES = Tiles(**tiles.lookup("linear_tpu"))  # the table's rule: 512 columns a step


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def rms(y, w):  # float64 RMSNorm over the last axis
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + EPS) * f64(w)


def check(out, expected, dtype):
    """Within the rows' dtype's rounding of the largest value (the kernel rounds where the model does)."""
    assert out.dtype == dtype and out.shape == expected.shape
    rtol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(f64(out), expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def arrays(dtype, seed: int, *shapes, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(offset + scale * rng.standard_normal(s), dtype) for s in shapes]


def attention_case(dtype):
    """x [M, K], norm, q [K, 16, 72], k and v [K, 1, 72], biases [H, 72], q and k head norms, cos and
    sin [M, 24] (a rotated half of 24: R 48 of 72 columns rotated)."""
    x, norm = arrays(dtype, 0, (M, K), (K,))
    norm = 1 + 0.2 * norm
    ws = arrays(dtype, 1, (K, H, DH), (K, 1, DH), (K, 1, DH), scale=K**-0.5)
    biases = arrays(dtype, 2, (H, DH), (1, DH), (1, DH))
    head_norms = (*arrays(dtype, 3, (DH,), (DH,), scale=0.2, offset=1.0), None)
    angles = np.random.default_rng(4).uniform(0, 6, (M, HALF))
    rope = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    return x, norm, ws, biases, head_norms, rope


def expected_attention(x, norm, ws, biases, head_norms, rope):
    h = rms(f64(x), norm)
    outs = []
    for w, b, hn in zip(ws, biases, head_norms):
        z = (h @ f64(w).reshape(K, -1) + f64(b).reshape(-1)).reshape(M, -1, DH)
        if hn is not None:  # q and k: normed per head, then rotated
            z = rms(z, hn)
            x1, x2 = z[..., :HALF], z[..., HALF : 2 * HALF]
            c, s = f64(rope[0])[:, None], f64(rope[1])[:, None]
            z = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, z[..., 2 * HALF :]], axis=-1)
        outs.append(z)  # [M, H, Dh]: heads as attention reads them
    return outs


@functools.partial(jax.jit, static_argnames=("precision", "tiles", "interleave"))
def qkv(x, norm, ws, biases, head_norms, rope, precision=None, tiles=TILES, interleave=False):
    return fused_linear(
        x,
        ws,
        norm=norm,
        eps=EPS,
        biases=biases,
        head_dim=DH,
        head_norms=head_norms,
        rope=rope,
        rotate=(True, True, False),
        precision=precision,
        interleave=interleave,
        tiles=tiles,
        interpret=True,
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_qkv_is_normed_rows_times_heads_biased_normed_and_rotated(dtype):
    """q|k|v in one call, the weights in their model's shape [K, H, Dh], each output [M, H, Dh]: the
    input RMSNorm, each product, its bias, q's and k's head norms and the rotate-half rotary of their first 48 columns;
    float32 at full precision ("highest": float32 products)."""
    case = attention_case(dtype)
    outs = qkv(*case, precision="highest" if dtype == jnp.float32 else None)
    for out, want in zip(outs, expected_attention(*case), strict=True):
        check(out, want, dtype)


def test_k_and_v_interleaved_are_one_output_of_alternating_heads():
    """`interleave`: k and v (two heads each here) as one output [M, 2 * H_kv, Dh], k's head j at row
    2j and v's at 2j + 1 (the interleaved page pool's), each its own values."""
    x, norm, ws, biases, head_norms, rope = attention_case(jnp.float32)
    ws = (ws[0], jnp.concatenate([ws[1], ws[1][:, :, ::-1]], axis=1), jnp.concatenate([ws[2], 2 * ws[2]], axis=1))
    biases = (biases[0], jnp.concatenate([biases[1], -biases[1]]), jnp.concatenate([biases[2], biases[2]]))
    q, k, v = qkv(x, norm, ws, biases, head_norms, rope, precision="highest")
    q2, kv = qkv(x, norm, ws, biases, head_norms, rope, precision="highest", interleave=True)
    assert kv.shape == (M, 4, DH)
    np.testing.assert_array_equal(np.asarray(q2), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(jnp.stack([k, v], axis=2).reshape(M, 4, DH)))


def test_a_layer_is_read_in_its_stacks():
    """Layer 1 of stacks [3, ...] of every weight, the norm, biases and head norms (`LayerOf`, a traced
    index) gives the layer's own arrays' outputs, bit for bit; at 128-column steps q's 16 heads are
    two steps of 8 (Mosaic's least block of heads), k and v one each."""
    x, norm, ws, biases, head_norms, rope = attention_case(jnp.float32)
    own = (norm, ws, biases, head_norms)
    stacks = jax.tree.map(lambda a: jnp.stack([a * 0.5, a, a * 2.0]), own)  # None (v's head norm) stays None

    @jax.jit
    def stacked(stacks, i):
        norm, ws, biases, head_norms = jax.tree.map(lambda a: LayerOf(a, i), stacks)
        return qkv(x, norm, ws, biases, head_norms, rope, tiles=Tiles(128))

    got, want = stacked(stacks, jnp.int32(1)), qkv(x, *own, rope, tiles=Tiles(128))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("shape", ["heads", "rows", "columns"])
def test_output_projection_adds_bias_and_residual(shape):
    """The output projection: attended rows [M, H * Dh] (or of heads [M, H, Dh], as attention wrote
    them) times o in its model's shape [H, Dh, N] (N 200: one block) or a [K, N] of three 128-column
    blocks, its bias, then the residual."""
    n = 384 if shape == "columns" else 200
    a, residual, bias = arrays(jnp.bfloat16, 5, (M, H, DH) if shape == "heads" else (M, H * DH), (M, n), (n,))
    (o,) = arrays(jnp.bfloat16, 6, (H * DH, n) if shape == "columns" else (H, DH, n), scale=(H * DH) ** -0.5)
    (y,) = jax.jit(
        lambda a, o, bias, res: fused_linear(a, (o,), biases=(bias,), residual=res, tiles=Tiles(128), interpret=True)
    )(a, o, bias, residual)
    check(y, f64(a).reshape(M, -1) @ f64(o).reshape(H * DH, n) + f64(bias) + f64(residual), jnp.bfloat16)


def test_normed_rows_come_first_and_float32_weights_multiply_at_float32():
    """The router's call: the normed rows [M, K] (the experts'), then bf16 rows times float32 weights
    as float32 logits [M, 40]."""
    x, norm = arrays(jnp.bfloat16, 7, (M, K), (K,))
    (w,) = arrays(jnp.float32, 8, (K, 40), scale=K**-0.5)
    h, logits = fused_linear(x, (w,), norm=norm, normed=True, precision="highest", tiles=TILES, interpret=True)
    assert (h.dtype, logits.dtype) == (jnp.bfloat16, jnp.float32)
    check(h, rms(f64(x), norm), jnp.bfloat16)
    check(logits, f64(h) @ f64(w), jnp.float32)


def test_refusals_name_what_is_wrong():
    """A gated product is XLA's (the kernel has no activation; the catalog's check refuses it, so a
    dense MLP keeps XLA's ops); a head epilogue needs its segment in heads [K, H, head_dim]; rows of
    heads take weights [H, Dh, N] of their heads."""
    x, norm, ws, biases, head_norms, rope = attention_case(jnp.float32)
    with pytest.raises(ValueError, match="no gated activation"):
        fused_linear(x, (ws[0].reshape(K, -1),), act=jax.nn.silu, tiles=TILES, interpret=True)
    for name in ("pallas_tpu_linear", "interpret_tpu_linear"):
        record = catalog.kernel(catalog.DECODE, name)
        assert "no gated activation" in record.why_not("tpu", None, "bfloat16", "unquantized", [(K, 2 * 96, True)])
        assert record.why_not("tpu", None, "bfloat16", "unquantized", [(K, 72, False)]) is None
    with pytest.raises(ValueError, match=r"a head epilogue takes a segment of heads \[K, H, head_dim=72\]"):
        fused_linear(x, (ws[0].reshape(K, -1),), head_dim=DH, head_norms=(head_norms[0],), tiles=TILES, interpret=True)
    with pytest.raises(ValueError, match=r"interleave takes two last segments of heads of one shape"):
        fused_linear(x, ws[:2], head_dim=DH, interleave=True, tiles=TILES, interpret=True)
    with pytest.raises(ValueError, match=r"rows of heads \(3, 16, 72\) take no norm and weights \[H, Dh, N\]"):
        fused_linear(jnp.zeros((M, H, DH)), (jnp.zeros((H * DH, 8)),), tiles=TILES, interpret=True)


def compiled_layer(rows: int):
    """Qwen3-30B-A3B's q|k|v (input norm, q [2048, 32, 128], k and v [2048, 4, 128], head norms, full
    rotary; k|v interleaved) and output projection ([32, 128, 2048] and the residual, reading q's [rows, 32, 128] as it
    lies) of stacks of 2 layers, bf16, on a v5e: each call's launches and temporary bytes."""
    dt = jnp.bfloat16

    def step(x, norm, q, k, v, qn, kn, cos, sin, o, i):
        view = lambda a: LayerOf(a, i)  # noqa: E731
        q, kv = fused_linear(x, (view(q), view(k), view(v)), norm=view(norm), head_dim=128,
                               head_norms=(view(qn), view(kn), None), rope=(cos, sin), rotate=(True, True, False),
                               out_dtype=dt, interleave=True, tiles=TILES)  # fmt: skip
        (y,) = fused_linear(q, (view(o),), residual=x, out_dtype=dt, tiles=TILES)
        return y, kv

    shapes = [((rows, 2048), dt), ((2, 2048), dt), ((2, 2048, 32, 128), dt), ((2, 2048, 4, 128), dt)]
    shapes += [((2, 2048, 4, 128), dt), ((2, 128), dt), ((2, 128), dt), ((rows, 64), jnp.float32)]
    shapes += [((rows, 64), jnp.float32), ((2, 32, 128, 2048), dt), ((), jnp.int32)]
    compiled = jax.jit(step).lower(*(on("v5e", s, d) for s, d in shapes)).compile()
    return hlo.by_kind(hlo.launches(compiled.as_text())), compiled.memory_analysis().temp_size_in_bytes


def test_compiled_for_a_v5e_each_group_is_one_kernel_reading_its_layer_in_place():
    """Two Mosaic calls (q|k|v, then the output projection), and no weight copied out of its stack: no
    fusion, and less temporary memory than one head's [2048, 128] columns (the layer index's copy:
    a scalar)."""
    kinds, temp = compiled_layer(64)  # a serving batch's rows (batch 1: the layer's, test_target_structure)
    assert kinds.get("custom-call tpu_custom_call") == 2, kinds
    assert not {"fusion", "dynamic-slice"} & set(kinds), kinds
    assert temp < 2048 * 128 * 2, temp
