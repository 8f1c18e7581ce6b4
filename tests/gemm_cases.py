"""Grouped-GEMM cases the kernel tests share (`test_kernels.py`, `test_kernels_compiled.py`): ragged
group sizes, a numpy reference, weights in each format, gate|up and down (combine) products."""

from __future__ import annotations

import functools
import zlib

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from moejax.model.layers import ClampedSwiGLU, silu_glu
from pallas_kernels.gmm_pallas_gpu import gmm_pallas_gpu
from pallas_kernels.gmm_pallas_tpu import gmm_pallas_tpu


def make_case(seed: int, scenario: str, dtype, m=45, k=128, n=256, groups=6, local=None):
    """Returns lhs [M, K], rhs [G_local, K, N] f32, group_sizes [G], group_offset."""
    rng = np.random.default_rng(seed)
    local = local or groups
    if scenario == "one_group":  # one group holds every row, the others are empty
        sizes = np.zeros(groups, np.int32)
        sizes[rng.integers(groups)] = m
    else:  # ragged sizes with empty groups; some trailing rows belong to no group
        sizes = rng.multinomial(m - 5, rng.dirichlet(np.ones(groups) * 0.5)).astype(np.int32)
        sizes[rng.choice(groups, 2, replace=False)] = 0
    offset = rng.integers(groups - local + 1) if scenario == "offset" else 0
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((local, k, n)) / np.sqrt(k), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes), int(offset)


def reference(lhs, rhs_f32, sizes, offset):
    """numpy: out[r] = lhs[r] @ rhs[g - offset] for rows of local groups g, else 0."""
    lhs, rhs_f32, sizes = (np.asarray(a, np.float32) for a in (lhs, rhs_f32, sizes))
    out = np.zeros((lhs.shape[0], rhs_f32.shape[2]), np.float32)
    ends = np.cumsum(sizes).astype(int)
    for j in range(rhs_f32.shape[0]):
        lo, hi = ends[offset + j] - sizes[offset + j], ends[offset + j]
        out[int(lo) : hi] = lhs[int(lo) : hi] @ rhs_f32[j]
    return out


def weights(rhs_f32, fmt, dtype):
    """The rhs as passed to grouped_gemm, and its exact f32 value for the reference."""
    if fmt == "dense":
        w = rhs_f32.astype(dtype)
        return w, w.astype(jnp.float32)
    q = pk.quantize(rhs_f32, fmt)
    return q, pk.dequantize(q)


def tolerance(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


# Rows: a prefill's many (the loop over touched groups) and a decode step's few (gathered per row).
ROWS = [70, 12]


KERNELS = {
    "interpret_tpu": functools.partial(gmm_pallas_tpu, interpret=True),
    "interpret_triton": functools.partial(gmm_pallas_gpu, interpret=True),
}


GLU_ACTS = {"swiglu": silu_glu, "clamped_swiglu": ClampedSwiGLU(alpha=1.702, limit=7.0)}
# Each backend runs both activations, every format and both dtypes over these three cases.
GLU_CASES = [
    ("dense", jnp.float32, "swiglu"),
    ("nvfp4", jnp.bfloat16, "clamped_swiglu"),
    ("mxfp4", jnp.float32, "clamped_swiglu"),
]


def glu_case(fmt, dtype, n=512):
    """A gate|up grouped GEMM's operands: rows, a gate_up stack (NVFP4: a tensor scale per half),
    group sizes, offset, a bias [G_local, N]."""
    lhs, rhs, sizes, offset = make_case(zlib.crc32(f"glu/{fmt}".encode()), "offset", dtype, n=n, local=3)
    w = rhs.astype(dtype) if fmt == "dense" else pk.quantize_experts(rhs, fmt, gated=True)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((3, n)), dtype)
    return lhs, w, sizes, offset, bias


def picks_case(seed: int, tokens: int, fmt: str, k=4, groups=8, local=3, d=64, n=48):
    """T tokens' k picks sorted by expert, as `moe_local` hands them to the down product: lhs
    [T*k, d], rhs [local, d, n] (experts [offset, offset + local) of `groups`), group sizes,
    offset, (order [T*k], weights [T, k]), bias [local, n], and the expected [T, n] in numpy."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(groups, k, replace=False) for _ in range(tokens)])  # [T, k]
    order = np.argsort(ids.reshape(-1), kind="stable")
    rows = rng.standard_normal((tokens * k, d)).astype(np.float32)  # each pick's row, in pick order
    pick_weights = rng.random((tokens, k)).astype(np.float32)
    rhs = jnp.asarray(rng.standard_normal((local, d, n)) / np.sqrt(d), jnp.float32)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    bias, offset = rng.standard_normal((local, n)).astype(np.float32), 2
    expected = np.zeros((tokens, n), np.float32)
    for t, j in np.ndindex(tokens, k):
        if offset <= ids[t, j] < offset + local:
            e = ids[t, j] - offset
            expected[t] += pick_weights[t, j] * (rows[t * k + j] @ np.asarray(w_f32[e]) + bias[e])
    sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=groups), jnp.int32)
    combine = (jnp.asarray(order, jnp.int32), jnp.asarray(pick_weights))
    return jnp.asarray(rows[order]), w, sizes, offset, combine, jnp.asarray(bias), expected
