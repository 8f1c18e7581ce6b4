"""Every row on every device: tensor_sliced, expert_sharded and hybrid.

The three differ only in the mesh shape ((1, N), (N, 1), (ep, tp)): each device runs the
picks of the experts it holds (whole, or its slice of the intermediate dimension) for all
rows, and a reduce-scatter sums the partial outputs back to the rows' own devices.
Runs inside `shard_map` over ("ep", "tp").
"""

from __future__ import annotations

import jax

from sharding.experts import moe_local
from sharding.rules import ALL


def gather_scatter(x, ids, weights, w, *, rows_sharded: bool, num_experts: int, kernel: str):
    """x: [T_local, D] (or [T, D] when rows are replicated) -> same shape."""
    if rows_sharded:  # DP attention: each device starts with its own rows; gather them all
        x, ids, weights = (jax.lax.all_gather(a, ALL, tiled=True) for a in (x, ids, weights))
    e_local = w["gate"].shape[0]
    y = moe_local(x, ids, weights, w, num_groups=num_experts, group_offset=jax.lax.axis_index("ep") * e_local,
                  kernel=kernel, first_slice=jax.lax.axis_index("tp") == 0)
    return jax.lax.psum_scatter(y, ALL, tiled=True) if rows_sharded else jax.lax.psum(y, ALL)
