"""A MoE layer's share of a decode step on a mesh, at its launch budget: Qwen3-30B-A3B's decode step
compiled for 8 compile-only H100s (XLA:GPU's own compiler, `moejax.base.targets`), a layer read as
the difference of two depths (`moejax.analysis.layer_ops`, what `plan --target` prints). Each
device runs the decode kernels on its own rows (DP attention: q|k|v, the output projection and the
router), the experts by pick (at 256 requests too: every device's experts see the 256 rows the
placement gathers, `platform.DECODE_PICK_ROWS`), and the placement's exchange."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
from compile_only import in_own_process

from moejax.analysis.layer_ops import DEPTHS, layer_ops
from moejax.analysis.target_pricing import CATEGORIES
from moejax.base import targets
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from sharding import registry

# Kernels and collectives a GQA family's MoE layer may take.
KERNELS, COLLECTIVES = 16, 3
KERNEL_GROUPS = ("fusions", "custom calls", "copies", "sorts", "other")
# ragged_a2a plans its exchange with XLA's ops: over the kernel budget (docs/placements.md).
OVER_BUDGET = {"ragged_a2a"}


@functools.cache
def layer(placement: str, batch: int) -> dict:
    """A layer of Qwen3-30B-A3B's decode step at `batch` under `placement` on 8 H100s."""
    config = Config(
        model=preset("qwen3-moe-30b-a3b"),
        layout=LayoutConfig(devices=8, placement=placement),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    return layer_ops(config, batch, 4096, targets.target("h100"), list(targets.devices("h100", 8)), 16)


@pytest.mark.parametrize("batch", [64, 256])
@pytest.mark.parametrize("placement", [p for p in registry.names() if p not in OVER_BUDGET])
def test_a_moe_layer_on_8_h100s_runs_within_its_budget(placement, batch):
    """At batch 64 and 256 (8 and 32 requests a device): at most KERNELS kernels and COLLECTIVES
    collectives a layer, and at least one of each (what it parsed)."""
    groups = layer(placement, batch)["groups"]
    kernels = sum(groups[g] for g in KERNEL_GROUPS)
    assert 0 < kernels <= KERNELS, groups
    assert 0 < groups["collectives"] <= COLLECTIVES, groups


GLM_PLACEMENTS = ("expert_sharded", "tensor_sliced")
# The absorbed attention's products over the cached latent, each its own op on the XLA path.
MLA_ATTENTION_PRODUCTS = ("bhtr,bsr->bhts", "bhtk,bsk->bhts", "bhts,bsr->bhtr")


def glm_layer(placement: str) -> dict:
    """GLM-5.3 with NVFP4 experts at batch 64 on 8 B200s under `placement`: its layer's ops."""
    config = Config(
        model=preset("glm-5.3"),
        layout=LayoutConfig(devices=8, placement=placement),
        weights=WeightsConfig("nvfp4"),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    return layer_ops(config, 64, 4096, targets.target("b200"), list(targets.devices("b200", 8)), 16)


@functools.cache
def glm_layers() -> dict[str, dict]:
    """`glm_layer` of each of GLM_PLACEMENTS, in a process of their own (`in_own_process`): its
    paged attention is a Mosaic GPU kernel for the B200, and this process compiles Hopper's."""
    return in_own_process(__file__)


@pytest.mark.parametrize("placement", GLM_PLACEMENTS)
def test_glm_5_3s_moe_layer_on_8_b200s_exchanges_within_its_budget(placement):
    """GLM-5.3 with NVFP4 experts (MLA, the DSA indexer, a sliced shared expert) at batch 64 on 8
    B200s: at most COLLECTIVES collectives a layer (the rows' all-gather and the reduce-scatter, the
    shared expert's merged into them), at least one. Its kernels are past the MLA budget: its
    indexer's scores and top-k are XLA's ops (docs/placements.md)."""
    groups = glm_layers()[placement]["groups"]
    assert 0 < groups["collectives"] <= COLLECTIVES, groups
    assert sum(groups[g] for g in KERNEL_GROUPS) > 0, groups


@pytest.mark.parametrize("placement", GLM_PLACEMENTS)
def test_glm_5_3s_projections_on_8_b200s_are_the_dense_kernels(placement):
    """MLA's projections (`latent`: q_a, kv_a and the indexer's, then q_b and the indexer's queries;
    `out`: the output projection with the residual) are the dense decode kernel's launches: no XLA
    product of q_b nor of the output projection left."""
    parts = {p["part"] for p in glm_layers()[placement]["parts"]}
    assert {"attention/latent", "attention/out"} <= parts, parts
    assert not {"attention/btr,rhk->bthk", "attention/bthv,hvd->btd"} & parts, parts


@pytest.mark.parametrize("placement", GLM_PLACEMENTS)
def test_glm_5_3s_attention_on_8_b200s_is_one_mosaic_gpu_kernel(placement):
    """The absorbed MLA attention over the paged latent (`auto` on a B200: our Mosaic GPU kernel's
    `latent_attention`) is one Mosaic GPU call a layer, and none of its products is an XLA op."""
    parts = glm_layers()[placement]["parts"]
    attention = [p for p in parts if p["part"].startswith("attention")]
    assert attention, parts
    kernels = sum(p["ops"] for p in attention if p["kind"] == "custom-call mosaic_gpu_v2")
    assert kernels == 1, attention
    assert not [p for p in attention if p["part"].split("/")[-1] in MLA_ATTENTION_PRODUCTS], attention


def test_a_moe_layer_priced_on_h100s_adds_up():
    """The layer priced on the H100 (`predicted`): its kernels and collectives are the layer's ops,
    its parts (attention, experts, exchange, rest) sum to its time, each part with ops in it takes
    some, the time is at least its bytes at 3.35 TB/s and its kernels' launches, and the step is the
    3-layer step's time and the layer's 45 times more."""
    ops = layer("expert_sharded", 64)
    p, groups, h100 = ops["predicted"], ops["groups"], targets.target("h100")
    assert p["target"] == "h100"
    assert p["kernels"] == pytest.approx(sum(groups[g] for g in KERNEL_GROUPS))
    assert p["collectives"] == groups["collectives"] > 0
    assert p["layer_bytes"] == ops["layer_bytes"] > 0
    assert set(p["layer_parts_us"]) == set(CATEGORIES)
    assert p["layer_us"] == pytest.approx(sum(p["layer_parts_us"].values()))
    assert min(p["layer_parts_us"][c] for c in ("attention", "experts", "exchange")) > 0, p
    # the exchange: at least its collectives' latencies; the whole: at least the bytes and launches
    assert p["layer_parts_us"]["exchange"] >= p["collectives"] * h100.collective_us * 0.99
    assert p["layer_us"] >= ops["layer_bytes"] / (h100.hbm_tb_s * 1e6) + p["kernels"] * h100.launch_us * 0.99
    layers = preset("qwen3-moe-30b-a3b").num_layers
    assert p["shallow_step_us"] > p["layer_us"] * DEPTHS[0] * 0.5
    assert p["step_ms"] == pytest.approx((p["shallow_step_us"] + (layers - DEPTHS[0]) * p["layer_us"]) / 1e3, rel=1e-3)


if __name__ == "__main__":  # glm_layers' process
    Path(sys.argv[1]).write_text(json.dumps({placement: glm_layer(placement) for placement in GLM_PLACEMENTS}))
