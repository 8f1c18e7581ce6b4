"""What this jax and a device offer the kernels, asked without importing a backend or touching a
deprecated name: the catalog's records (`catalog.Kernel.why_not`) read their answers here.

A jax module that deprecates a name serves it through its module `__getattr__`, which warns on
every access (jax 0.11.2's `plgpu.transpose_ref`), so `hasattr` is no probe: a name counts as
present when it is in the module's own namespace, or still served by its `_deprecations` table.
Pure Python at import: `moejax.base.platform` reads `gpu_major` before jax is loaded.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util


def missing(module: str, names: tuple[str, ...]) -> list[str]:
    """Those of `names` that jax module `module` (imported here) does not have, as `module.name`."""
    found = importlib.import_module(module)
    served = {name for name, (_, value) in getattr(found, "_deprecations", {}).items() if value is not None}
    return [f"{module}.{name}" for name in names if name not in vars(found) and name not in served]


@functools.cache
def has_triton() -> bool:
    """Whether this jax has Pallas's Triton backend (jax 0.11 deprecated it), found without importing
    it (the import of a deprecated backend may warn)."""
    try:
        return importlib.util.find_spec("jax.experimental.pallas.triton") is not None
    except ImportError:
        return False


def jax_version() -> str:
    return importlib.import_module("jax").__version__


def gpu_major(device) -> int | None:
    """The major version of `device`'s compute capability (9: Hopper, 10: Blackwell); None for a
    device that has none (a CPU or TPU device, or a GPU jax does not describe)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return int(capability.split(".")[0]) if capability else None


def capability(device) -> str:
    """`device`'s compute capability as a GPU's name for it ("9.0": "sm_90")."""
    return f"sm_{str(device.compute_capability).replace('.', '')}"
