"""What a grouped GEMM does to its f32 product before writing it: column scales and a bias per
group, then, for a gate|up product, the gated activation that halves its columns; for a down
product, the sum of each token's picks (`combine`).

A gate_up stack [G, K, 2F] interleaves gate and up (gate in even columns), so any tile of 2f
adjacent columns holds f whole (gate, up) pairs: the Pallas kernels apply `finish` and `glu`
to each tile and write [rows, F]; the XLA loop applies the same functions to each chunk of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gate_up_columns(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """y: [..., 2F] from a gate|up product, gate and up interleaved (gate in even columns, as
    gpt-oss publishes its experts) -> (gate, up): [..., F] each."""
    return y[..., 0::2], y[..., 1::2]


def finish(acc: jax.Array, out_dtype, scale=None, bias=None) -> jax.Array:
    """acc [rows, N] f32 -> (acc * scale) in out_dtype, + bias (in out_dtype), as an unfused
    product followed by a bias add computes it. scale: scalar or [1 or rows, N]; bias: [1 or rows, N]."""
    y = (acc if scale is None else acc * scale).astype(out_dtype)
    return y if bias is None else y + bias.astype(out_dtype)


def glu(gate: jax.Array, up: jax.Array, act) -> jax.Array:
    """act(gate, up) [rows, F] in the product's dtype."""
    return act(gate, up).astype(gate.dtype)


def group_rows(table: jax.Array, group_sizes: jax.Array, group_offset, m: int) -> jax.Array:
    """table: [G_local, N] -> [m, N]: each sorted row's group's row of table; zero for rows of
    other groups (and past the last group), whose products are zero too."""
    g = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right", method="compare_all") - group_offset
    mine = (g >= 0) & (g < table.shape[0])
    return jnp.where(mine[:, None], table[jnp.clip(g, 0, table.shape[0] - 1)], 0)


def finish_product(
    out: jax.Array, out_dtype, scale, bias, group_sizes: jax.Array, group_offset, act=None, combine_picks=None
) -> jax.Array:
    """A whole product out [M, N] finished after it: scaled (scale: [M, N] or None), each row's
    group's row of bias [G_local, N] added, then a gate|up product through act(gate, up) ->
    [M, N/2], or a down product's rows summed into their tokens (`combine_picks`: (order,
    weights) of `combine`) -> [T, N]."""
    rows_bias = None if bias is None else group_rows(bias, group_sizes, group_offset, out.shape[0])
    y = finish(out, out_dtype, scale, rows_bias)
    if combine_picks is not None:
        return combine(y, *combine_picks)
    return y if act is None else glu(*gate_up_columns(y), act)


def combine(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """y_sorted: [T*k, N] in pick-sorted order (`order`: sorted row -> flat pick) -> [T, N], each
    token's picks weighted and summed.

    Un-sorting and a per-row weighted sum (rather than a scatter-add) keeps the sum order fixed
    on every backend (an accelerator's scatter-add may add in any order); the rows are un-sorted
    by a gather through the inverse permutation (scattering rows into a zeroed [T*k, N] costs
    XLA:CPU several times more: the zeros, then the scatter).
    """
    t, k = weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y_sorted[inverse].reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(jnp.float32), weights).astype(y_sorted.dtype)
