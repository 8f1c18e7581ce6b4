"""moejax: a pure-JAX reference runtime for large Mixture-of-Experts models.

Imported before jax, it starts jax as the CLI does (`moejax.launch.startup`): on a host with no
accelerator attached (and no JAX_PLATFORMS of the user's) on the CPU, with the compile-only
plugins of the `targets` extra loaded quietly, so that a user's script or a benchmark opens with
its own output, not the CUDA plugin's missing driver or libtpu's missing TPU.
"""

import sys

if "jax" not in sys.modules:
    from moejax.launch.startup import jax_platforms, quiet_native_logs

    quiet_native_logs()
    jax_platforms()
