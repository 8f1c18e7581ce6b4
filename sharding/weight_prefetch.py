"""Weights travel to the rows: each device keeps E/N experts of every layer at rest and
all-gathers a layer's other experts `depth` layers ahead of use, so the gather overlaps the
compute of the layers before it. Rows never leave their device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax


class PrefetchedExperts(Sequence):
    """The expert weights of each MoE layer, gathered in full. Asking for layer i issues the
    gathers of layers up to i + depth first (trace order is issue order), so layer i's
    experts were requested `depth` layers before they are used."""

    def __init__(self, layers: Sequence[dict], gather: Callable[[dict], dict], depth: int):
        self.layers, self.gather, self.depth = layers, gather, depth
        self.gathered: dict[int, dict] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> dict:
        for j in range(i, min(i + self.depth, len(self.layers) - 1) + 1):
            if j not in self.gathered:
                self.gathered[j] = self.gather(self.layers[j])
        return self.gathered.pop(i)


def gather_experts(w: dict, axis: str) -> dict:
    """Inside shard_map: this device's experts [E/N, ...] -> all experts [E, ...]."""
    return jax.tree.map(lambda a: jax.lax.all_gather(a, axis, axis=0, tiled=True), w)
