"""`moejax generate` keeps its compiled programs in the persistent cache, so a second identical
run compiles nothing, and its --json output says where the run's time went."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test starts moejax processes

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


def test_first_run_fills_the_cache_including_small_programs(runs):
    (_, entries), _ = runs
    assert any(e.startswith("jit_prefill") for e in entries)
    assert any(e.startswith("jit_decode_step") for e in entries)
    # Parameter init and sampling compile in well under jax's default 1 s threshold.
    assert len(entries) > 10


def test_second_run_compiles_nothing_new_and_gives_the_same_tokens(runs):
    (first, before), (second, after) = runs
    assert after == before
    assert second["tokens"] == first["tokens"]


def test_json_reports_timing(runs):
    timing = runs[0][0]["timing"]
    assert set(timing) == {"load_s", "compile_s", "prefill_ms", "decode_step_ms"}
    assert all(v >= 0 for v in timing.values())
    assert timing["compile_s"] > 0
