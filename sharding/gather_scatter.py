"""Every row on every device: the exchange of the placements that differ only in mesh shape.

Each device runs the picks of the experts it holds (whole, or its slice of the intermediate
dimension) for all rows, and a reduce-scatter sums the partial outputs back to the rows' own
devices. Runs inside `shard_map` over ("ep", "tp").
"""

from __future__ import annotations

import jax
import numpy as np

from sharding import accounting, overlap
from sharding.experts import moe_local
from sharding.mesh import MeshPlacement
from sharding.rules import ALL


class GatherScatter(MeshPlacement):
    """All-gather the rows, run the local experts' picks, reduce-scatter the outputs."""

    def exchange(self, x, ids, weights, w):
        return overlap.run(self.phases(w), self.two_batch_overlap, x, ids, weights)

    def phases(self, w) -> overlap.Phases:
        def dispatch(x, ids, weights):  # DP attention: each device starts with its own rows; gather them all
            return (
                tuple(jax.lax.all_gather(a, ALL, tiled=True) for a in (x, ids, weights))
                if self.rows_sharded
                else (x, ids, weights)
            )

        def compute(sent):
            e_local = w["down"].shape[0]
            return moe_local(
                *sent,
                w,
                num_groups=self.num_experts,
                group_offset=jax.lax.axis_index("ep") * e_local,
                kernel=self.kernel,
                first_slice=jax.lax.axis_index("tp") == 0,
                platform=self.platform,
                decode=self.decode,
            )

        def combine(y):
            return jax.lax.psum_scatter(y, ALL, tiled=True) if self.rows_sharded else jax.lax.psum(y, ALL)

        return overlap.Phases(dispatch, compute, combine)

    def bytes_sent_per_device(self, ids, hidden, act_bytes, experts=None):
        n, (t, k) = self.devices, ids.shape
        if n == 1:
            return np.zeros(1)
        row = hidden * act_bytes
        if self.rows_sharded:  # all-gather rows (+ picks), reduce-scatter partial outputs
            per = (n - 1) * -(-t // n) * (2 * row + k * accounting.PICK_BYTES)
        else:  # every row already everywhere: one all-reduce (ring: 2 (n-1)/n of the buffer)
            per = 2 * (n - 1) / n * t * row
        return np.full(n, float(per))
