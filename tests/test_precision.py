"""float32 means float32: a float32 run's products at full precision on every platform (XLA:GPU
and Triton would multiply float32 as TF32, the TPU in one bf16 pass); a bf16 run's at the
platform's default. And no float32 program aborts XLA:GPU."""

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.engine.sampling import Sampling
from moejax.launch.factory import build_engine

HIGHEST = "precision = [HIGHEST, HIGHEST]"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_programs_trace_their_products_at_the_runs_precision(dtype):
    """Every product of a float32 engine's prefill, decode step and decode block (the grouped
    GEMM's and the attention's included) is traced at HIGHEST; a bf16 engine's at the default."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(devices=1), engine=EngineConfig(dtype=dtype)).validate()
    engine = build_engine(config, None, seed=0)
    b, n = 2, 16
    rows = jnp.zeros(b, jnp.int32)
    seeds = jnp.asarray(np.arange(b, dtype=np.int32))
    texts = [
        engine._prefill.lower(
            engine.params,
            engine.new_cache(b, n),
            jnp.zeros((b, n), jnp.int32),
            jnp.int32(0),
            rows,
            all_logits=False,
            record=False,
        ).as_text(),
        engine._decode.lower(
            engine.params, engine.new_cache(b, n), rows, rows, seeds, 1, sampling=Sampling(), record=False
        ).as_text(),
        engine._decode_block.lower(
            engine.params, engine.new_cache(b, n), rows, rows, seeds, 1, 4, block=4, sampling=Sampling()
        ).as_text(),
    ]
    for text in texts:
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert dots
        assert sum(HIGHEST in line for line in dots) == (len(dots) if dtype == "float32" else 0)


def test_an_h100s_float32_decode_step_compiles_with_full_precision_products():
    """The tests' tiny DeepSeek-V3 decode step compiled for a compile-only H100 as the engine jits it:
    in float32 it compiles (XLA:GPU's dot merger once set up a Triton GEMM fusion whose tiling
    aborted the process) and every XLA product and cuBLAS call is at HIGHEST and every Pallas
    Triton dot at "ieee" (Triton's default, which its IR leaves unprinted); in bf16 none is forced,
    and no Pallas Triton dot runs (a Hopper's bf16 decode set is Mosaic GPU's, or XLA's ops where it
    refuses the widths)."""
    pytest.importorskip("jax_plugins.xla_cuda12")
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("h100_precision.py")), "float32", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    aborts = [line for line in run.stderr.splitlines() if "Check failed" in line]
    assert run.returncode == 0, aborts or run.stderr[-3000:]
    f32, bf16 = (json.loads(line) for line in run.stdout.splitlines())
    assert f32["dots"] and set(f32["dots"]) == {"highest,highest"}
    assert set(f32["cublas"]) <= {"highest,highest"}
    assert f32["triton_dots"] and all("xf32>" in d and "tf32" not in d for d in f32["triton_dots"])
    assert bf16["dots"] and "highest,highest" not in bf16["dots"] and "highest,highest" not in bf16["cublas"]
    assert f32["decode"] == "triton" and bf16["decode"] in ("mosaic_gpu", "xla") and bf16["triton_dots"] == []
