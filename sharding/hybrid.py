"""The mix: ep groups of tp devices; a group holds E/ep experts, each sliced tp ways inside it."""

from moejax.config import ConfigError
from sharding.gather_scatter import GatherScatter


class Hybrid(GatherScatter):
    name = "hybrid"
    mesh_from_layout = True

    @classmethod
    def mesh_shape(cls, layout):
        """ep x tp from the layout; with neither given, pairs of devices (the mix's smallest
        group, as Row-Meets-Experts's --ep-size 4 on 8 GPUs) where the devices pair up."""
        n = layout.devices
        tp = layout.tp or (n // layout.ep if layout.ep else 2 - n % 2)
        ep = layout.ep or n // tp
        if ep * tp != n:
            raise ConfigError(f"{cls.name} needs ep * tp = devices; got ep={ep} x tp={tp} for {n} devices")
        return ep, tp
