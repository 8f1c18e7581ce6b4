"""Gate and up projections as the one gate_up matrix a run multiplies by: columns interleaved
(gate in even columns, `pallas_kernels.epilogue.gate_up_columns`), whatever form they come in.

Floats interleave as they are. 4-bit experts (as a file holds them, or as a checkpoint of an
earlier format restored them) interleave their values and block scales along N, which lies
outside their blocks (along K): no bit of either half changes. NVFP4's per-matrix tensor
scales become column-wise, [E, 1, 2F], each half keeping its own.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from checkpoints.quantization import PackedExperts
from moejax.model.layers import interleave_gate_up
from pallas_kernels.formats import QuantizedArray


def _columns(tensor_scale, n: int):
    """A tensor scale [..., 1, 1] (or already [..., 1, n]) as [..., 1, n]."""
    xp = np if isinstance(tensor_scale, np.ndarray) else jnp
    return xp.broadcast_to(tensor_scale, (*tensor_scale.shape[:-1], n))


def fuse(gate, up):
    """gate, up: [..., K, F] (numpy, `PackedExperts` or `QuantizedArray` along K) -> [..., K, 2F]."""
    if isinstance(gate, (PackedExperts, QuantizedArray)):
        if type(up) is not type(gate) or up.fmt != gate.fmt:
            raise ValueError(
                f"gate and up in different forms: {type(gate).__name__} {gate.fmt}, "
                f"{type(up).__name__} {getattr(up, 'fmt', 'float')}"
            )
        n = gate.values.shape[-1]
        ts = (
            None
            if gate.tensor_scale is None
            else interleave_gate_up(_columns(gate.tensor_scale, n), _columns(up.tensor_scale, n))
        )
        return dataclasses.replace(
            gate,
            values=interleave_gate_up(gate.values, up.values),
            scales=interleave_gate_up(gate.scales, up.scales),
            tensor_scale=ts,
        )
    return interleave_gate_up(gate, up)
