"""Test setup: 8 virtual CPU devices for the meshes, set before jax is imported anywhere."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests check results, not speed: cheaper LLVM code generation halves XLA:CPU compile times,
# which are most of the suite's time.
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Programs the CLI compiles in subprocesses (test_startup, the exit-code tests) go to a fresh
# cache directory per run, so that nothing carries over between runs. The test process itself
# does not write a persistent cache: in two full runs of this suite, jaxlib 0.10.2 segfaulted
# serializing an XLA:CPU executable (`executable.serialize()` in
# `compilation_cache.put_executable_and_time`), each time in a different test of
# test_placements.py, while those tests alone passed.
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="moejax-test-xla-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"

import jax  # noqa: E402  (after the XLA flags above)

jax.config.update("jax_enable_compilation_cache", False)
