"""A parameter as read (a float array, or 4-bit experts as published) in the form a run
computes with, and onto a placement.

Float expert matrices are quantized when the run asks for 4-bit experts
(`pallas_kernels.run_weights`, in the placement's K-slices). 4-bit experts read as published
(`PackedExperts`) are repacked from the file's adjacent pairs into the in-memory packing of each
K-slice (`packing.from_disk`), bit for bit: no requantization. Everything else (expert biases
included) is cast to the run dtype. Placements then only pad and put (`Placement.place`).
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels
from checkpoints import packing
from checkpoints.quantization import PackedExperts
from moejax.errors import UsageError
from moejax.model.params import ParamSpec, is_expert_matrix, param_dtype


def run_form(spec: ParamSpec, array, dtype, expert_format: str, k_slices: int = 1, kernel: str = "auto"):
    """One parameter as a run of `expert_format` experts computes with it."""
    if isinstance(array, PackedExperts):
        if expert_format != array.fmt:
            raise UsageError(f"the checkpoint's experts are {array.fmt}; they run as {array.fmt} (not {expert_format})")
        values = packing.from_disk(jnp.asarray(array.values), k_slices)
        q = pallas_kernels.QuantizedArray(values, jnp.asarray(array.scales), None if array.tensor_scale is None
                                          else jnp.asarray(array.tensor_scale), fmt=array.fmt, axis=-2)
        return pallas_kernels.for_kernel(q, kernel)
    array = array.astype(param_dtype(spec, dtype))
    if is_expert_matrix(spec):
        return pallas_kernels.run_weights(array, expert_format, k_slices, kernel)
    return array


def place_tensor(placement, spec: ParamSpec, array, dtype):
    """One parameter (host or device array, or `PackedExperts`) on its devices, in the run's form."""
    config = placement.config
    return placement.place(spec, run_form(spec, array, dtype, config.weights.expert_format, placement.k_slices(spec),
                                          config.kernel))
