"""A CLI process's start-up settings: numpy's large buffers on small pages unless asked otherwise;
`moejax generate` keeps its compiled programs in the persistent cache, so a second identical run
compiles nothing, and its --json output says where the run's time went."""

import json
import os
import subprocess
import sys

import pytest

from moejax.launch.startup import host_pages

ARGV = ["generate", "--preset", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]


def generate(cache_dir) -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # conftest's; the CLI's own default here
    proc = subprocess.run([sys.executable, "-m", "moejax", *ARGV], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two identical runs on one fresh cache directory: [(output, cache entries after it)]."""
    cache_dir = tmp_path_factory.mktemp("xla-cache")
    out = []
    for _ in range(2):
        result = generate(cache_dir)
        out.append((result, sorted(os.listdir(cache_dir))))
    return out


@pytest.mark.slow  # starts moejax processes
def test_first_run_fills_the_cache_including_small_programs(runs):
    (_, entries), _ = runs
    assert any(e.startswith("jit_prefill") for e in entries)
    assert any(e.startswith("jit_decode_step") for e in entries)
    # Parameter init and sampling compile in well under jax's default 1 s threshold.
    assert len(entries) > 10


@pytest.mark.slow
def test_second_run_compiles_nothing_new_and_gives_the_same_tokens(runs):
    (first, before), (second, after) = runs
    assert after == before
    assert second["tokens"] == first["tokens"]


@pytest.mark.slow
def test_json_reports_timing(runs):
    timing = runs[0][0]["timing"]
    assert set(timing) == {"load_s", "compile_s", "prefill_ms", "decode_step_ms"}
    assert all(v >= 0 for v in timing.values())
    assert timing["compile_s"] > 0


@pytest.mark.parametrize("env, huge", [(None, False), ("0", False), ("1", True)])
def test_numpy_buffers_take_small_pages_unless_the_environment_asks(env, huge, monkeypatch):
    """numpy asks for 2 MB pages by default; a start asks it not to, and NUMPY_MADVISE_HUGEPAGE wins."""
    from numpy._core import multiarray

    if env is None:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    else:
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", env)
    before = multiarray._set_madvise_hugepage(True)  # numpy's default: on
    try:
        assert host_pages() is huge
        assert multiarray._set_madvise_hugepage(True) is huge  # returns the setting it replaces
    finally:
        multiarray._set_madvise_hugepage(before)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (arguments, what its stdout shows): the devices it ran on, the benchmark's usage
STARTS = {
    "a script importing moejax": (
        ["-c", "import moejax, jax; jax.numpy.zeros(1).block_until_ready(); print(jax.devices())"],
        "CpuDevice",
    ),
    "a benchmark": ([os.path.join(ROOT, "benchmarks", "grouped_gemm_cpu.py"), "--help"], "usage:"),
}


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("start", list(STARTS))
def test_a_script_starts_jax_quietly_on_the_cpu(start):
    """Outside the CLI, on this host without an accelerator (and no JAX_PLATFORMS of the user's),
    jax starts on the CPU without a line on stderr: not the CUDA plugin's missing driver (the
    `targets` extra's compile-only plugin), nor libtpu's missing TPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    argv, shows = STARTS[start]
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert shows in proc.stdout
