"""Grouped GEMM in plain XLA: a loop over the touched groups only.

For each local group with rows, the loop loads (and, for 4-bit weights, dequantizes) that
group's [K, N] once, then multiplies its rows in chunks: full chunks of `tm` rows, then the
remainder split into power-of-two chunks (tm/2, tm/4, .., 1), each run only if its bit is
set. Every chunk lies inside its group, so each row is computed exactly once and written
with a plain dynamic_update_slice; untouched groups' weights are never read. This keeps
decode bound by the touched experts' bytes and prefill close to one einsum per group
(`jax.lax.ragged_dot` is ~60x slower than an einsum on XLA:CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import decode, formats
from pallas_kernels.metadata import local_groups


def _pick_tm(m: int, num_groups: int) -> int:
  """Chunk rows: ~2x the mean rows per group, a power of two in [8, 512], at most m."""
  mean = max(1, 2 * m // max(num_groups, 1))
  tm = min(512, max(8, 1 << (mean - 1).bit_length()))
  return min(tm, 1 << (m.bit_length() - 1))


def _group_matmul(rhs, g: jax.Array):
  """Loads group g of rhs once; returns apply(x [rows, K] f32) -> [rows, N] f32.

  A 4-bit rhs is decoded for this group only, as the two K-halves its bytes hold, so the
  product is x[:, :K/2] @ lo + x[:, K/2:] @ hi with no interleave. Math is f32: XLA:CPU's
  bf16 dots are several times slower than its f32 ones, and the reference stays exact.
  """
  # Tying rhs to the loop-varying g keeps XLA from hoisting the convert / decode of the
  # whole [G, K, N] out of the loop (XLA:CPU moves converts above the dynamic-slice), which
  # would read every group's weights on every call.
  rhs, g = lax.optimization_barrier((rhs, g))
  w = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, g, 0, keepdims=False), rhs)
  if not isinstance(w, formats.QuantizedArray):
    w = w.astype(jnp.float32)  # [K, N]
    return lambda x: jnp.dot(x, w)
  kh, block = w.values.shape[0], w.spec.block
  bits = lax.bitcast_convert_type(w.scales, jnp.uint8)  # [K/B, N]
  lo, hi = decode.decode_tile(w.values, bits[: kh // block], bits[kh // block :], block, w.fmt)
  scale = 1.0 if w.tensor_scale is None else w.tensor_scale  # [1, 1]
  return lambda x: (jnp.dot(x[:, :kh], lo) + jnp.dot(x[:, kh:], hi)) * scale


def gmm_xla(lhs, rhs, group_sizes, group_offset, out_dtype, tm: int | None = None):
  """lhs [M, K], rhs [G_local, K, N] (array or QuantizedArray), group_sizes [G] -> [M, N]."""
  m, n = lhs.shape[0], rhs.shape[2]
  g_local = rhs.shape[0]
  tm = tm or _pick_tm(m, g_local)
  lhs32 = lhs.astype(jnp.float32)  # [M, K], once rather than per chunk
  starts, sizes, active, num_active = local_groups(group_sizes, group_offset, g_local, m)

  def chunk(out, matmul, pos, rows: int):
    x = lax.dynamic_slice_in_dim(lhs32, pos, rows, 0)  # [rows, K]
    return lax.dynamic_update_slice_in_dim(out, matmul(x), pos, 0)

  def group_body(i, out):
    g = active[i]
    w = _group_matmul(rhs, g)
    start, size = starts[g], sizes[g]
    n_full = size // tm
    out = lax.fori_loop(0, n_full, lambda j, o: chunk(o, w, start + j * tm, tm), out)
    pos, rem = start + n_full * tm, size % tm
    c = tm // 2
    while c >= 1:
      take = (rem & c) != 0
      out = lax.cond(take, lambda o, p, c=c: chunk(o, w, p, c), lambda o, p: o, out, pos)
      pos = pos + jnp.where(take, c, 0)
      c //= 2
    return out

  # f32 out [M, N] in the loop: XLA:CPU handles a bf16 loop carry through f32 round trips.
  out = lax.fori_loop(0, num_active, group_body, jnp.zeros((m, n), jnp.float32))
  return out.astype(out_dtype)
