"""Slices: every device holds 1/N of every expert's intermediate dimension (a 1 x N mesh)."""

from moejax.base.platform import Platform
from moejax.config import ConfigError
from sharding.gather_scatter import GatherScatter


class TensorSliced(GatherScatter):
    name = "tensor_sliced"
    holds_every_expert = True

    def __init__(self, config, mesh=None, platform: Platform | None = None):
        layout = config.layout
        if layout.redundant_experts or layout.eplb or layout.eplb_online:
            raise ConfigError(
                "tensor_sliced holds every expert on every device: expert placement (--eplb, "
                "--eplb-online, --redundant-experts) does not apply to it"
            )
        super().__init__(config, mesh, platform)

    @classmethod
    def mesh_shape(cls, layout):
        return cls.fixed_mesh(layout, (1, layout.devices))
