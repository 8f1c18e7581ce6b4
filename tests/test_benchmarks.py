"""The benchmark scripts stay runnable: they are not imported by the package, and the GPU one
is run blind on borrowed device time, so a break must show here first."""

from __future__ import annotations

import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_compiles(script):
    py_compile.compile(str(script), doraise=True)


def test_gpu_benchmark_smoke_run_prints_every_kernel_row():
    script = next(p for p in BENCHMARKS if p.name == "gpu_grouped_gemm.py")
    run = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "FAILED" not in run.stdout, run.stdout
    rows = [f for f in map(str.split, run.stdout.splitlines()) if f[:1] in (["ragged_dot"], ["interpret_gpu"])]
    # ragged_dot plus bf16 / nvfp4 / mxfp4 kernels at each of the smoke's two batch sizes
    assert [r[1] for r in rows] == ["bf16", "bf16", "nvfp4", "mxfp4"] * 2
    errors = {r[1]: float(r[-1]) for r in rows}
    assert errors["bf16"] < 1e-2  # the bf16 kernel against ragged_dot: same products
