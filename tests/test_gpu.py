"""The goldens on a real GPU: every family's stored transformers outputs (tests/golden, made by
make_goldens.py) against the engine with the kernels `auto` picks there (the Triton grouped GEMM;
with pages, the Triton paged attention).

Runs with `python -m pytest -m gpu` on a host with an NVIDIA GPU (conftest.py then hands jax the
GPU); skipped everywhere else. float32 holds transformers' logits to 1e-4, as on the CPU, which
needs full-precision products (TF32 is ~1e-3 off); bf16 keeps the argmax and the mean error the
CPU suite asks of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_paged_attention_mgpu as mgpu_cases
from hf_reference import FAMILIES
from test_model import GOLDEN, assert_close_relative, make_engine

from pallas_kernels import paged_attention_mgpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")]

ENGINES = {"contiguous": {}, "paged": {"page_size": 16}}


def _golden(family: str) -> dict:
    expected = np.load(GOLDEN / family / "expected.npz")
    return {"prompt": expected["prompt"].tolist(), "logits": expected["logits"], "greedy": expected["greedy"].tolist()}


@pytest.mark.parametrize("cache", ENGINES)
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_transformers_on_the_gpu(family, cache):
    golden = _golden(family)
    engine = make_engine(GOLDEN / family, dtype="float32", **ENGINES[cache])
    assert engine.placement.kernel == "pallas_gpu"
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


# Our Mosaic GPU paged attention (not yet the engine's `pallas_gpu`), compiled for this GPU: its
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
