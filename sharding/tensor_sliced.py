"""Slices: every device holds 1/N of every expert's intermediate dimension (a 1 x N mesh)."""

from sharding.gather_scatter import GatherScatter


class TensorSliced(GatherScatter):
    name = "tensor_sliced"

    @classmethod
    def mesh_shape(cls, layout):
        return cls.fixed_mesh(layout, (1, layout.devices))
