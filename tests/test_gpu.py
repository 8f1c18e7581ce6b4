"""The goldens on a real GPU: every family's stored transformers outputs (tests/golden, made by
make_goldens.py) against the engine with the kernels `auto` picks there (the Triton grouped GEMM;
with pages, the Triton paged attention).

Runs with `python -m pytest -m gpu` on a host with an NVIDIA GPU (conftest.py then hands jax the
GPU); skipped everywhere else. float32 holds transformers' logits to 1e-4, as on the CPU, which
needs full-precision products (TF32 is ~1e-3 off); bf16 keeps the argmax and the mean error the
CPU suite asks of it. On a Hopper GPU, the Mosaic GPU grouped GEMM (`gmm_mosaic_gpu`) runs compiled
against float64, its PTX built and run where no CPU test reaches (tests/test_mosaic_gpu_kernels.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hf_reference import FAMILIES
from test_model import GOLDEN, assert_close_relative, make_engine
from test_mosaic_gpu_kernels import CASES, Case, assert_matches, run

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


@pytest.mark.skipif(not HOPPER, reason="wgmma needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("name", list(MOSAIC_CASES))
def test_mosaic_gpu_kernel_matches_float64_on_hopper(name):
    assert_matches(*run(MOSAIC_CASES[name], interpret=False), MOSAIC_CASES[name].out_dtype)
