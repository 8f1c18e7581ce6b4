"""The decode products on Mosaic GPU (`linear_mgpu.fused_linear`) without a GPU: jax's Mosaic GPU
interpreter runs each epilogue against float64 numpy at widths no tile divides (K 200 in steps of
64, N 72 in tiles of 32, 3 rows of a 64-row wgmma); jax's Mosaic GPU lowering and XLA:GPU compile
the attention q|k|v product for a compile-only H100. Its PTX is assembled and run only on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on_h100

from moejax.compiled import hlo
from moejax.model.layers import silu_glu
from pallas_kernels import tiles
from pallas_kernels.linear_mgpu import Tiles, fused_linear

M, K, EPS = 3, 200, 1e-6
TILES = Tiles(n=32, k=64, splits=1, steps=3)  # 4 K steps refill 3 stages; N 72 is 3 tiles, the last of 8 columns


def bf16(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def f64(a):
    return np.asarray(a, np.float64)


def rms(y, w):  # float64 RMSNorm over the last axis
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + EPS) * f64(w)


def check(out, expected):
    """Within bf16's rounding of the largest value (the kernel rounds where the model does)."""
    assert out.dtype == jnp.bfloat16 and out.shape == expected.shape
    np.testing.assert_allclose(f64(out), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("m,splits", [(M, 1), (M, 2), (70, 1)])
def test_normed_product_with_bias_and_residual(m, splits):
    """RMSNorm of the rows, the product, its bias, then the residual added (an output projection's);
    70 rows: two row tiles, the second of 6 rows (x padded to whole 8-row TMA tiles)."""
    rng = np.random.default_rng(0)
    x, norm, w = bf16(rng, m, K), bf16(rng, K, scale=0.2) + 1, bf16(rng, K, 72, scale=K**-0.5)
    bias, residual = bf16(rng, 72), bf16(rng, m, 72)
    (y,) = fused_linear(
        x,
        (w,),
        norm=norm,
        eps=EPS,
        biases=(bias,),
        residual=residual,
        tiles=Tiles(n=32, k=64, splits=splits, steps=3),
        interpret=True,
    )
    check(y, rms(f64(x), norm) @ f64(w) + f64(bias) + f64(residual))


@pytest.mark.parametrize("splits", [1, 2])
def test_gated_activation_of_interleaved_gate_up(splits):
    """A gate|up product (gate in even columns) through SiLU(gate) * up: [M, 72] of 144 columns."""
    rng = np.random.default_rng(1)
    x, w, bias = bf16(rng, M, K), bf16(rng, K, 144, scale=K**-0.5), bf16(rng, 144)
    chosen = Tiles(n=32, k=64, splits=splits, steps=3)
    (y,) = fused_linear(x, (w,), biases=(bias,), act=silu_glu, tiles=chosen, interpret=True)
    z = f64(x) @ f64(w) + f64(bias)
    gate, up = z[:, 0::2], z[:, 1::2]
    check(y, gate / (1 + np.exp(-gate)) * up)


@pytest.mark.parametrize("splits", [1, 2])
def test_head_norm_and_rotary_of_q_and_k(splits):
    """q|k|v in one call: q (2 heads of 64) and k (1 head) biased, normed per head, their first 32
    columns rotated by rotate-half RoPE and the rest kept; v (72 columns) biased only."""
    rng = np.random.default_rng(2)
    dh, half = 64, 16
    x, norm = bf16(rng, M, K), bf16(rng, K, scale=0.2) + 1
    ws = tuple(bf16(rng, K, n, scale=K**-0.5) for n in (128, 64, 72))
    biases = tuple(bf16(rng, w.shape[1]) for w in ws)
    head_norms = (bf16(rng, dh, scale=0.2) + 1, bf16(rng, dh, scale=0.2) + 1, None)
    angles = rng.uniform(0, 6, (M, half))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    outs = fused_linear(
        x,
        ws,
        norm=norm,
        eps=EPS,
        biases=biases,
        head_dim=dh,
        head_norms=head_norms,
        rope=(cos, sin),
        rotate=(True, True, False),
        tiles=Tiles(n=32, k=64, splits=splits, steps=3),
        interpret=True,
    )
    h = rms(f64(x), norm)
    for out, w, b, hn in zip(outs, ws, biases, head_norms):
        z = h @ f64(w) + f64(b)
        if hn is not None:
            z = rms(z.reshape(M, -1, dh), hn)
            x1, x2 = z[..., :half], z[..., half : 2 * half]
            c, s = f64(cos)[:, None], f64(sin)[:, None]
            z = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, z[..., 2 * half :]], axis=-1).reshape(M, -1)
        check(out, z)


def test_refuses_float32_with_its_reason():
    """wgmma multiplies float32 as TF32; the kernel says so rather than lose precision."""
    x, w = jnp.ones((M, K), jnp.float32), jnp.ones((K, 72), jnp.float32)
    with pytest.raises(ValueError, match="TF32"):
        fused_linear(x, (w,), tiles=TILES, interpret=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_normed_rows_come_first(splits):
    """The router's call: the normed rows [M, K] (what the experts multiply next), then the logits."""
    rng = np.random.default_rng(3)
    x, norm, w = bf16(rng, M, K), bf16(rng, K, scale=0.2) + 1, bf16(rng, K, 72, scale=K**-0.5)
    chosen = Tiles(n=32, k=64, splits=splits, steps=3)
    h, y = fused_linear(x, (w,), norm=norm, eps=EPS, normed=True, tiles=chosen, interpret=True)
    check(h, rms(f64(x), norm))
    check(y, rms(f64(x), norm) @ f64(w))


QKV = dict(d=2048, dh=128, dims=(4096, 512, 512))  # Qwen3-30B-A3B's attention: 32 q heads, 4 kv heads


def qkv_tiles() -> dict:
    """The table's tiles for the q|k|v product at one row on an H100 (132 SMs), as the model's
    `projections._fused` counts the kernel's programs."""
    dims, dh = QKV["dims"], QKV["dh"]

    def programs(tn, splits):  # a head a program, unless K splits (then column tiles in each slice)
        if splits > 1:
            return sum(-(-n // tn) for n in dims) * splits
        return (dims[0] + dims[1]) // dh + -(-dims[2] // tn)

    return tiles.lookup(
        "linear_mgpu", ("NVIDIA H100 80GB HBM3", 132), rows=1, k=QKV["d"], n=sum(dims), programs=programs,
        tn_floor=64, n_field="n", k_field="k", max_splits=QKV["d"] * 2 // 64,
    )  # fmt: skip


def test_qkv_tiles_fill_an_h100():
    """40 heads leave most of 132 SMs idle: the table's tiles split K in 4 over 80 column tiles of 64."""
    assert qkv_tiles() == dict(n=64, k=128, splits=4, steps=3)


@pytest.mark.parametrize("split", [False, True])
def test_qkv_compiles_for_h100_to_mosaic_gpu_calls_only(split):
    """The q|k|v product at one row, normed, q and k head-normed and rotated: one Mosaic GPU call
    (K whole), or two (the table's split K: the slices' products, then their sum's epilogue), and
    no other launch (no Triton kernel, no XLA fusion) for a compile-only H100."""
    d, dh, dims = QKV["d"], QKV["dh"], QKV["dims"]
    chosen = Tiles(**qkv_tiles()) if split else Tiles(n=128, k=128, splits=1, steps=3)

    def step(x, norm, q, k, v, qn, kn, cos, sin):
        return fused_linear(
            x, (q, k, v), norm=norm, head_dim=dh, head_norms=(qn, kn, None), rope=(cos, sin),
            rotate=(True, True, False), tiles=chosen,
        )  # fmt: skip

    args = [on_h100((1, d), jnp.bfloat16), on_h100((d,), jnp.bfloat16)]
    args += [on_h100((d, n), jnp.bfloat16) for n in dims]
    args += [on_h100((dh,), jnp.bfloat16)] * 2 + [on_h100((1, dh // 2), jnp.float32)] * 2
    launches = hlo.launches(jax.jit(step).lower(*args).compile().as_text())
    assert launches, "the compiled program launches nothing to look through"
    assert [r.instr.pallas for r in launches] == ["mosaic_gpu"] * (2 if split else 1)
