"""What the pick GEMMs (`gmm_picks` on Triton, `gmm_picks_mgpu` on Mosaic GPU) share: their bound on
the picks and their operand checks, in a module of its own so that neither backend imports the other's."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import formats, layered

# A decode step's picks at most: each program holds all P ids in registers (Triton's compares them
# with a chunk's tm slots, [tm, P], and its compile time grows with P); a prefill's rows go through
# the grouped GEMM.
MAX_PICKS = 4096


def check_operands(lhs, rhs, ids, k: int, rows_are_picks: bool, act) -> None:
    """One clear error for operands a pick GEMM cannot take."""
    if lhs.ndim != 2 or ids.ndim != 1 or jnp.dtype(ids.dtype) != jnp.int32:
        raise ValueError(
            f"pick_gemm takes lhs [rows, K] and ids [P] int32, got {lhs.shape} and {ids.dtype}{list(ids.shape)}"
        )
    p = ids.shape[0]
    if p > MAX_PICKS:
        raise ValueError(f"pick_gemm multiplies a decode step's picks, at most {MAX_PICKS} picks; got {p}")
    rows = p if rows_are_picks else p // k if k > 0 and p % k == 0 else None
    if rows != lhs.shape[0]:
        want = "[P, K] (rows_are_picks)" if rows_are_picks else f"[P / k, K] with k={k} dividing P={p}"
        raise ValueError(f"pick_gemm: lhs must be {want}, got {list(lhs.shape)}")
    if len(rhs.shape) != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"pick_gemm: rhs must be [G, K={lhs.shape[1]}, N], got {list(rhs.shape)}")
    stack = layered.stored(rhs)
    if isinstance(stack, formats.QuantizedArray) and stack.axis != -2:
        raise ValueError("pick_gemm: a 4-bit rhs must be quantized along K (axis=-2)")
    if act is not None and rhs.shape[2] % 2:
        raise ValueError(f"pick_gemm: a gated activation takes (gate, up) column pairs, got N={rhs.shape[2]}")
