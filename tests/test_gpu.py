"""The goldens on a real GPU: every family's stored transformers outputs (tests/golden, made by
make_goldens.py) against the engine with the kernels `auto` picks there (the Triton grouped GEMM;
with pages, our Mosaic GPU paged attention); on a Blackwell (sm_100) GPU also the two Blackwell grouped
GEMMs (4-bit x 4-bit, bf16 x 4-bit) against float64 products.

Runs with `python -m pytest -m gpu` on a host with an NVIDIA GPU (conftest.py then hands jax the
GPU); skipped everywhere else. float32 holds transformers' logits to 1e-4, as on the CPU, which
needs full-precision products (TF32 is ~1e-3 off); bf16 keeps the argmax and the mean error the
CPU suite asks of it. On a Hopper GPU, the Mosaic GPU grouped GEMM (`gmm_mosaic_gpu`) runs compiled
against float64, its PTX built and run where no CPU test reaches (tests/test_mosaic_gpu_kernels.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_paged_attention_mgpu as mgpu_cases
from hf_reference import FAMILIES
from test_blackwell import bf16_kernel
from test_model import GOLDEN, assert_close_relative, make_engine
from test_mosaic_gpu_kernels import CASES, Case, assert_matches, run

import pallas_kernels as pk
from moejax.model.layers import silu_glu
from pallas_kernels import paged_attention_mgpu
from pallas_kernels.layered import LayerOf
from pallas_kernels.registry import is_blackwell

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")]

ENGINES = {"contiguous": {}, "paged": {"page_size": 16}}
# wgmma is sm_90a's: Blackwell has none.
HOPPER = jax.default_backend() == "gpu" and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
# The interpreter's cases, and models' widths: long K pipelines, many N tiles.
MOSAIC_CASES = {
    **CASES,
    "bf16, model widths": Case("dense", 2048, 768),
    "nvfp4 gate_up of a layer, model widths": Case(
        "nvfp4", 2048, 1536, "swiglu", gated=True, layer=True, out_dtype="bfloat16"
    ),
    "mxfp4 gate_up, model widths": Case("mxfp4", 2880, 1152, "clamped_swiglu", gated=True, out_dtype="bfloat16"),
}


def _golden(family: str) -> dict:
    expected = np.load(GOLDEN / family / "expected.npz")
    return {"prompt": expected["prompt"].tolist(), "logits": expected["logits"], "greedy": expected["greedy"].tolist()}


@pytest.mark.parametrize("cache", ENGINES)
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_transformers_on_the_gpu(family, cache):
    golden = _golden(family)
    engine = make_engine(GOLDEN / family, dtype="float32", **ENGINES[cache])
    assert engine.placement.kernel == "triton"
    assert_close_relative(engine.score([golden["prompt"]])[0], golden["logits"])
    assert engine.generate([golden["prompt"]], 16).tokens[0] == golden["greedy"]


@pytest.mark.parametrize("cache", ENGINES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_keeps_transformers_argmax_on_the_gpu(family, cache):
    golden = _golden(family)
    engine = make_engine(GOLDEN / family, dtype="bfloat16", **ENGINES[cache])
    logits = engine.score([golden["prompt"]])[0]
    ref = golden["logits"]
    assert np.abs(logits - ref).mean() < 0.02 * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    again = engine.generate([golden["prompt"]], 16).tokens[0]
    assert again == engine.generate([golden["prompt"]], 16).tokens[0]  # deterministic


@pytest.mark.skipif(not HOPPER, reason="wgmma needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_gpu_kernel_matches_float64_on_hopper(name):
    assert_matches(*run(MOSAIC_CASES[name], interpret=False), MOSAIC_CASES[name].out_dtype)


# Ragged groups (two empty), rows past the groups, and the local experts 1..4 of 6.
SIZES, OFFSET, LOCAL = np.array([40, 0, 70, 25, 0, 45], np.int32), 1, 4


def _float64_product(rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    """rows [M, K] times each local group's expert w [LOCAL, K, N] in float64; other rows 0."""
    out = np.zeros((rows.shape[0], w.shape[2]))
    ends = np.cumsum(SIZES)
    for j in range(LOCAL):
        lo, hi = ends[OFFSET + j] - SIZES[OFFSET + j], ends[OFFSET + j]
        out[lo:hi] = rows[lo:hi] @ w[j]
    return out


# [K, N] of the experts: the fp4 kernel's tiles divide them (it takes no other); the bf16 kernel's
# do not (its last K step and last CTA's columns reach past the edge).
WIDTHS = {"blackwell": (512, 256), "blackwell_bf16": (576, 320)}


def _blackwell_case(kernel: str, fmt: str, act):
    """The kernel's product of 200 bf16 rows [200, K] and 4-bit experts [4, K, N] (without act:
    layer 1 of a stack of two, read where it lies), and its float64 reference: the rows as the
    kernel multiplies them (4-bit x 4-bit: quantized to fmt), the experts dequantized."""
    key, (k, n) = jax.random.key(0), WIDTHS[kernel]
    rows = jax.random.normal(key, (200, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (2, LOCAL, k, n), jnp.float32) / k**0.5
    stack = pk.quantize_experts(w, fmt, gated=act is not None)  # [2, LOCAL, K, N]
    layer = jax.tree.map(lambda a: a[1], stack)
    exact = np.asarray(pk.dequantize(layer), np.float64)
    sizes = jnp.asarray(SIZES)
    if kernel == "blackwell":
        ref_rows = np.asarray(pk.dequantize(pk.quantize(rows.astype(jnp.float32), fmt, axis=-1)), np.float64)
        prepared = pk.for_kernel(stack, "blackwell")
        rhs = LayerOf(prepared, 1) if act is None else jax.tree.map(lambda a: a[1], prepared)
        out = pk.grouped_gemm(rows, rhs, sizes, group_offset=OFFSET, backend="blackwell", act=act)
    else:
        ref_rows = np.asarray(rows, np.float64)
        if act is None:
            out = bf16_kernel(rows, LayerOf(stack, 1), sizes, OFFSET, jnp.bfloat16)
        else:  # as grouped_gemm hands a kernel that fuses the activation: column scales in the epilogue
            columns = None if layer.tensor_scale is None else layer.tensor_scale.reshape(LOCAL, -1)
            unit = layer.replace(tensor_scale=None)
            out = bf16_kernel(rows, unit, sizes, OFFSET, jnp.bfloat16, epilogue=(columns, None, act))
    ref = _float64_product(ref_rows, exact)
    if act is not None:
        gate, up = ref[:, 0::2], ref[:, 1::2]
        ref = gate / (1 + np.exp(-gate)) * up
    return np.asarray(out, np.float64), ref


@pytest.mark.skipif(
    jax.default_backend() != "gpu" or not is_blackwell(), reason="needs an NVIDIA Blackwell (sm_100) GPU"
)
@pytest.mark.parametrize("act", [None, silu_glu], ids=["plain", "swiglu"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kernel", ["blackwell", "blackwell_bf16"])
def test_blackwell_kernels_match_float64_products(kernel, fmt, act):
    """Each Blackwell kernel's product equals the float64 product of what it multiplies, within its
    bf16 output's rounding; rows of groups it does not hold, and rows past the groups, are 0."""
    out, ref = _blackwell_case(kernel, fmt, act)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    np.testing.assert_array_equal(out[: SIZES[0]], 0)  # group 0: not local
    np.testing.assert_array_equal(out[SIZES.sum() :], 0)  # past the groups


# Our Mosaic GPU paged attention (the engine's `mosaic_gpu`), compiled for this GPU: its
# PTX, and the semaphores that order its splits' combine, which the CPU tests' interpreter lacks.
@pytest.mark.parametrize("name", mgpu_cases.CASES)
def test_mosaic_gpu_paged_attention_equals_the_xla_path_on_the_gpu(name):
    for window in (0, 9):
        got = mgpu_cases.run(name, window=window, interpret=False)
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(mgpu_cases.xla(name, window), np.float32),
            **mgpu_cases.tolerance(name),
        )


def test_mosaic_gpu_paged_attention_reads_a_pages_the_table_names_none_as_nothing_on_the_gpu():
    case = mgpu_cases.CASES["sinks_odd_pages"]
    table = mgpu_cases.TABLE.copy()
    table[0, 1], table[1, 0] = mgpu_cases.PAGES, -1
    lens = np.array([23, 16, 0], np.int32)
    q, k, v, sinks = mgpu_cases.inputs(case)
    got = mgpu_cases.run("sinks_odd_pages", table=table, lens=lens, interpret=False)
    want = mgpu_cases.reference(q, k, v, table, lens, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 16])
def test_mosaic_gpu_paged_attention_at_gpt_oss_size_equals_the_xla_path_on_the_gpu(splits):
    """One request of 4,000 positions and one of 130 (pages of 16, scattered), gpt-oss's heads
    (64 over 8 kv heads of 64, sinks) in bf16, with and without a window of 128, against float64
    (the XLA path rounds its scores to bf16: 3x the kernel's error at 500 positions): batch 1's
    parallelism comes from the splits."""
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    pages, h, hkv, dh, ps = 300, 64, 8, 64, 16
    k, v = (jax.random.normal(key, (pages, hkv, ps, dh), jnp.bfloat16) for key in keys[:2])
    q = jax.random.normal(keys[2], (2, h, dh), jnp.bfloat16)
    sinks = jax.random.normal(keys[3], (h,))
    table = np.full((2, 256), pages, np.int32)
    table[0, :250] = np.random.default_rng(0).permutation(pages)[:250]
    table[1, :9] = np.arange(9) * 3
    lens = np.array([4000, 130], np.int32)
    step = jax.jit(
        lambda q, k, v, table, lens, window, sinks: paged_attention_mgpu.paged_attention(
            q, k, v, table, lens, scale=mgpu_cases.SCALE, window=window, sinks=sinks, pages_per_block=4, splits=splits
        )
    )
    for window in (0, 128):
        got = step(q, k, v, jnp.asarray(table), jnp.asarray(lens), jnp.int32(window), sinks)
        want = mgpu_cases.reference(q, k, v, table, lens, window, np.asarray(sinks))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=1e-2)  # bf16's rounding of ~2


# Its MLA attention (`latent_attention`), compiled for this GPU.
@pytest.mark.parametrize("name", mgpu_cases.LATENT_CASES)
def test_mosaic_gpu_latent_attention_equals_float64_on_the_gpu(name):
    got, want, _ = mgpu_cases.run_latent(name, interpret=False)
    mgpu_cases.assert_close(got, want, **mgpu_cases.latent_tolerance(name))


@pytest.mark.parametrize("splits", [1, 16])
def test_mosaic_gpu_latent_attention_at_glm_size_equals_float64_on_the_gpu(splits):
    """GLM-5.3's MLA on a device under DP attention: 64 heads over a latent of 512 and a rope key of
    64 in bf16, in CTAs of 16 heads (`latent_blocks`' choice), one request of 4,000 positions and one
    of 130 (pages of 64, scattered), half the positions selected, against float64."""
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    pages, h, c, r, ps = 80, 64, 512, 64, 64
    latent = jax.random.normal(keys[0], (pages, ps, c), jnp.bfloat16)
    k_rope = jax.random.normal(keys[1], (pages, ps, r), jnp.bfloat16)
    q = (jax.random.normal(keys[2], (2, h, c)) / 8).astype(jnp.bfloat16)
    q_rope = jax.random.normal(keys[3], (2, h, r), jnp.bfloat16)
    table = np.full((2, 64), pages, np.int32)
    table[0, :63] = np.random.default_rng(0).permutation(pages)[:63]
    table[1, :3] = np.arange(3) * 5
    lens = np.array([4000, 130], np.int32)
    keep = jax.random.bernoulli(keys[4], 0.5, (2, 64 * ps))
    got = jax.jit(
        lambda *a: paged_attention_mgpu.latent_attention(
            *a, scale=mgpu_cases.SCALE, heads=16, pages_per_block=1, splits=splits
        )
    )(q, q_rope, latent, k_rope, jnp.asarray(table), jnp.asarray(lens), keep)
    want = mgpu_cases.latent_reference(q, q_rope, latent, k_rope, table, lens, keep)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-2)
