"""The placements, by name: the only list of them. A new placement is a module with its
class plus one line here; the CLI's choices, `compare`, the simulator and the tests read it."""

from __future__ import annotations

import dataclasses

from moejax.base.platform import Platform, resolve
from moejax.config import Config, ConfigError
from pallas_kernels import catalog
from sharding import rules
from sharding.expert_sharded import ExpertSharded
from sharding.hybrid import Hybrid
from sharding.mesh import MeshPlacement, make_mesh
from sharding.placement import Placement
from sharding.ragged_a2a import RaggedA2A
from sharding.tensor_sliced import TensorSliced
from sharding.weight_prefetch import WeightPrefetch

REGISTRY: dict[str, type[MeshPlacement]] = {
    cls.name: cls for cls in (TensorSliced, ExpertSharded, Hybrid, RaggedA2A, WeightPrefetch)
}
DEFAULT = ExpertSharded.name  # layout.placement "" (a config that names none)


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def placement_class(name: str) -> type[MeshPlacement]:
    cls = REGISTRY.get(name or DEFAULT)
    if cls is None:
        raise ConfigError(f"unknown placement {name!r}; choose one of {', '.join(REGISTRY)}")
    return cls


def with_placement(config: Config, name: str, devices: int, ep: int = 0, tp: int = 0) -> Config:
    """`config` run under placement `name` on `devices` devices. ep / tp (else the layout's)
    apply only to a placement whose mesh the layout chooses; the others take their own."""
    cls = placement_class(name)
    if not cls.mesh_from_layout:
        ep = tp = 0
    else:
        ep, tp = ep or config.layout.ep, tp or config.layout.tp
    layout = dataclasses.replace(config.layout, placement=cls.name, devices=devices, ep=ep, tp=tp)
    return dataclasses.replace(config, layout=layout).validate()


def check_attention_kernel(config: Config, platform: Platform) -> None:
    """The paged attention can run on `platform`; one clear line otherwise (the grouped GEMM's
    refusals are `sharding.placement.gemm_kernel`'s)."""
    name = platform.attention_kernel(config.attention_kernel)
    reason = None if name == "xla" else catalog.attention(name).why_not(platform.name)
    if reason:
        raise ConfigError(f"attention kernel {config.attention_kernel}: {reason}")


def make_placement(config: Config, platform: Platform | None = None, devices: list | None = None) -> Placement:
    """The placement of `config.layout` (the single-device reference on one device), building
    programs for `platform` (default: this machine's, `moejax.base.platform.resolve`), on the machine's
    first `layout.devices` devices or on `devices` (a mesh even of one)."""
    if not config.layout.devices:
        raise ConfigError(
            "layout.devices 0 (this host's choice) is made by the verbs that run one model "
            "(generate, score, serve, bench); name a device count here"
        )
    cls = placement_class(config.layout.placement)
    platform = platform or resolve()
    check_attention_kernel(config, platform)
    rules.check_expert_widths(config.model, config.weights.expert_format)
    if devices is not None:
        return cls(config, make_mesh(cls.mesh_shape(config.layout), devices), platform=platform)
    if config.layout.devices == 1:
        return Placement(config, platform)
    return cls(config, platform=platform)
