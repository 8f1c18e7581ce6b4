"""What differs between the jax releases moejax runs on (pyproject's range, 0.10.2 to 0.12),
decided here and nowhere else; all other code uses spellings every one of them has."""

from __future__ import annotations


def triton_gpu_registry() -> dict | None:
    """jax's table of device kind -> GPU that Pallas' Triton lowering consults for a device that
    is not a GPU (jax 0.11 on: the lowering needs to know its GPU, so an export for cuda from
    a CPU host names one there); None on jax 0.10, whose lowering takes sm_90 where no GPU is."""
    from jax.experimental.pallas import triton as pl_triton

    if not hasattr(pl_triton, "get_gpu_info"):
        return None
    from jax._src.pallas.triton import gpu_info

    return gpu_info.registry
