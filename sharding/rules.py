"""Logical-axis rules: one table per placement, mapping parameter and activation axis names
to mesh axes, as MaxText and Flax's logical partitioning do.

The mesh is always ("ep", "tp"); each placement class chooses its shape (`mesh_shape`):
slices of every expert are (1, N), whole experts (N, 1), the mix (ep, tp).
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from moejax.config import ConfigError, LayoutConfig, ModelConfig
from pallas_kernels.formats import FORMATS

ALL = ("ep", "tp")  # every device


def rules(layout: LayoutConfig) -> dict[str, str | tuple | None]:
    """Logical axis -> mesh axes. Experts always live on 'ep' and their intermediate
    dimension on 'tp'; the mesh shape is what tells the placements apart."""
    return {
        "layers": None,  # a run's stacked layers: every device holds its share of each layer
        "experts": "ep",
        "expert_mlp": "tp",
        "batch": ALL if layout.attention == "dp" else None,
        "heads": ALL if layout.attention == "tp" else None,
        "kv_heads": ALL if layout.attention == "tp" else None,
        "mlp": ALL if layout.dense == "tp" else None,
        "shared_mlp": ALL if layout.shared_expert == "tp" else None,
        "embed": None,
        "vocab": ALL if layout.head == "tp" else None,
        "seq": None,
        "cache_seq": None,
        # A page pool: with DP attention each rank holds its share of the pages.
        "pages": ALL if layout.attention == "dp" else None,
        "page_slot": None,
        "head_dim": None,
    }


# The logical axes each dense group's weights slice along (`platform.DENSE_GROUPS`): attention's
# heads, the MLPs' intermediate columns; the router's slice along none.
DENSE_GROUP_AXES = {
    "attention": ("heads", "kv_heads"),
    "router": (),
    "mlp": ("mlp",),
    "shared_mlp": ("shared_mlp",),
}


def leaf_axes(axes: tuple, ndim: int) -> tuple:
    """The logical axes of one array of a parameter with logical `axes`: the same where the ranks
    agree; an array of another rank (the Blackwell kernel's scale tiling) keeps only its leading
    "layers" / "experts" axes and is replicated along the rest."""
    if ndim == len(axes):
        return axes
    return tuple(a if a in ("layers", "experts") else None for a in axes[:2]) + (None,) * (ndim - 2)


def devices(mesh_axes: str | tuple, mesh_sizes: dict[str, int]) -> int:
    """The devices mesh axes `mesh_axes` (a name or a tuple of them) span."""
    return math.prod(mesh_sizes[a] for a in ((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes))


def partition_spec(axes: tuple, shape: tuple, table: dict, mesh_sizes: dict[str, int]) -> P:
    """A PartitionSpec for one array. Axes that do not divide evenly stay replicated (a head
    count below the device count, say); the expert axes were checked up front (`check_model`)."""
    out = []
    for name, size in zip(axes, shape):
        mesh_axes = table.get(name) if name else None
        if mesh_axes is not None:
            n = devices(mesh_axes, mesh_sizes)
            if size % n:
                mesh_axes = None
        out.append(mesh_axes)
    return P(*out)


def check_model(c: ModelConfig, ep: int, tp: int, expert_format: str = "unquantized") -> None:
    """Expert slices must divide; expert counts need not (padding experts fill the last share).
    4-bit slices must also hold whole packed block pairs (2 x 16 values NVFP4, 2 x 32 MXFP4)."""
    f = c.moe_intermediate_size
    if f % tp:
        raise ConfigError(
            f"expert intermediate size {f} cannot be sliced {tp} ways ({f / tp:g} per device); "
            "choose a tp that divides it"
        )
    check_expert_widths(c, expert_format)
    unit = 2 * FORMATS[expert_format].block if expert_format in FORMATS else 1  # a byte pairs two blocks' values
    if tp > 1 and (f // tp) % unit:
        raise ConfigError(
            f"{expert_format} expert slices of {f // tp} (intermediate size {f} over {tp} devices) must be a "
            f"multiple of {unit}; use fewer tensor-parallel devices or bf16 experts"
        )


def check_expert_widths(c: ModelConfig, expert_format: str) -> None:
    """4-bit experts quantize their input axis (hidden_size for gate and up, moe_intermediate_size
    for down) in whole packed block pairs; checked before loading, whatever the placement."""
    if expert_format not in FORMATS:
        return
    unit = 2 * FORMATS[expert_format].block
    for name, width in (("hidden_size", c.hidden_size), ("moe_intermediate_size", c.moe_intermediate_size)):
        if width % unit:
            raise ConfigError(
                f"{expert_format} experts need {name} to be a multiple of {unit} (byte pairs of "
                f"{FORMATS[expert_format].block}-value blocks); this model's is {width}: run its experts "
                "unquantized (--expert-format unquantized)"
            )


def padded_experts(num_experts: int, ep: int) -> int:
    """Experts rounded up to a multiple of `ep`: empty padding experts are never picked."""
    return -(-num_experts // ep) * ep
