"""A MoE layer's share of a decode step on a mesh, at its launch budget: Qwen3-30B-A3B's decode step
compiled for 8 compile-only H100s (XLA:GPU's own compiler, `moejax.base.targets`), a layer read as
the difference of two depths (`moejax.analysis.layer_ops`, what `plan --target` prints). Each
device runs the decode kernels on its own rows (DP attention: q|k|v, the output projection and the
router), the experts by pick (at 256 requests too: every device's experts see the 256 rows the
placement gathers, `platform.DECODE_PICK_ROWS`), and the placement's exchange."""

from __future__ import annotations

import pytest

from moejax.analysis.layer_ops import layer_ops
from moejax.base import targets
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from sharding import registry

# Kernels and collectives a GQA family's MoE layer may take.
KERNELS, COLLECTIVES = 16, 3
KERNEL_GROUPS = ("fusions", "custom calls", "copies", "sorts", "other")
# ragged_a2a packs and unpacks its rows with XLA's ops: over the kernel budget (docs/placements.md).
OVER_BUDGET = {"ragged_a2a"}


@pytest.mark.parametrize("batch", [64, 256])
@pytest.mark.parametrize("placement", [p for p in registry.names() if p not in OVER_BUDGET])
def test_a_moe_layer_on_8_h100s_runs_within_its_budget(placement, batch):
    """At batch 64 and 256 (8 and 32 requests a device): at most KERNELS kernels and COLLECTIVES
    collectives a layer, and at least one of each (what it parsed)."""
    config = Config(
        model=preset("qwen3-moe-30b-a3b"),
        layout=LayoutConfig(devices=8, placement=placement),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    layer = layer_ops(config, batch, 4096, targets.target("h100"), list(targets.devices("h100", 8)), 16)
    groups = layer["groups"]
    kernels = sum(groups[g] for g in KERNEL_GROUPS)
    assert 0 < kernels <= KERNELS, groups
    assert 0 < groups["collectives"] <= COLLECTIVES, groups
