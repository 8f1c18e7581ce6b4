"""Whole experts, E/N per device, every row on every device (an N x 1 mesh)."""

from sharding.gather_scatter import GatherScatter


class ExpertSharded(GatherScatter):
    name = "expert_sharded"

    @classmethod
    def mesh_shape(cls, layout):
        return cls.fixed_mesh(layout, (layout.devices, 1))
