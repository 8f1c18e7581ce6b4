"""Parameters (read from a checkpoint, or random) onto a placement.

Floats go through `Placement.place` (which quantizes expert stacks when the run asks for
4-bit experts). 4-bit experts read as published (`PackedExperts`) are repacked from the file's
adjacent pairs into the in-memory packing of each K-slice (`packing.from_disk`), bit for bit:
no requantization. Expert biases are padded and sharded like their experts, never quantized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from checkpoints import packing
from checkpoints.quantization import PackedExperts
from moejax.errors import UsageError
from moejax.model.params import ParamSpec, param_dtype


def _pad_experts(a: np.ndarray, num_experts: int) -> np.ndarray:
    """Empty padding experts (never picked) up to the placement's expert count."""
    return np.pad(a, [(0, num_experts - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def place_packed(placement, spec: ParamSpec, p: PackedExperts):
    fmt = placement.config.weights.expert_format
    if fmt != p.fmt:
        raise UsageError(f"the checkpoint's experts are {p.fmt}; they run as {p.fmt} (not {fmt})")
    values, scales = (_pad_experts(a, placement.num_experts) for a in (p.values, p.scales))
    tensor_scale = None if p.tensor_scale is None else _pad_experts(p.tensor_scale, placement.num_experts)
    values = np.asarray(packing.from_disk(jnp.asarray(values), placement.k_slices(spec)))
    q = pallas_kernels.QuantizedArray(values, scales, tensor_scale, fmt=p.fmt, axis=-2)
    return jax.tree.map(lambda a: placement.put(a, spec.axes), q)


def place_tensor(placement, spec: ParamSpec, array, dtype):
    """One parameter (host or device array, or `PackedExperts`) on its devices, in the run's `dtype`."""
    if isinstance(array, PackedExperts):
        return place_packed(placement, spec, array)
    array = array.astype(param_dtype(spec, dtype))
    if spec.axes[:1] == ("experts",) and array.ndim < 3:  # expert biases [E, N]
        return placement.put(_pad_experts(np.asarray(array), placement.num_experts), spec.axes)
    return placement.place(spec, array)
