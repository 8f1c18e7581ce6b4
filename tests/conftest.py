"""Test setup: 8 virtual CPU devices for the meshes, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests check results, not speed: cheaper LLVM code generation halves XLA:CPU compile times,
# which are most of the suite's time.
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
