"""Test setup: 8 virtual CPU devices for the meshes, set before jax is imported anywhere."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# `pytest -m gpu` runs the GPU module on the host's GPU (tests/test_gpu.py); every other run, or a
# user's JAX_PLATFORMS, keeps jax on the virtual CPU devices.
_PLATFORMS_GIVEN = "JAX_PLATFORMS" in os.environ
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests check results, not speed: cheaper LLVM code generation halves XLA:CPU compile times,
# which are most of the suite's time.
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Many tests build engines that compile the same programs (same model, placement and shapes,
# new jit objects): a persistent cache for this run compiles each once. A fresh directory per
# run, so that nothing carries over between runs.
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moejax-test-xla-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
    if config.option.markexpr == "gpu" and not _PLATFORMS_GIVEN:
        jax.config.update("jax_platforms", None)  # jax's own choice: the GPU where one is attached


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends. Every live XLA:CPU executable
    holds ~10 memory mappings of JIT code, and the whole suite compiles thousands of programs:
    kept alive by jit caches they reach the kernel's 65,530 mappings per process, and XLA:CPU
    then fails to map code and segfaults (a full run crashed so before this fixture). Later modules
    that need a program again find it in the run's persistent compile cache."""
    yield
    jax.clear_caches()
    gc.collect()
