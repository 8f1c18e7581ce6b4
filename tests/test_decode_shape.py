"""The shape of a GPU's decode step at full width: Qwen3-30B-A3B's decode step compiled for a
compile-only H200 (XLA:GPU's own compiler, `moejax.base.targets`), at batch 1 and 64, with bf16 and
NVFP4 experts. A layer launches at most LAUNCHES_PER_LAYER kernels and writes no temporary of a
layer weight's shape (a weight copied, or a product spelled out as a multiply the weight's size
and a reduce), read off the compiled program by `moejax.compiled.hlo`.

A GPU runs every layer unrolled, each layer the same kernels: a layer's figures are the difference
of the steps of DEPTHS[1] and DEPTHS[0] layers (the embedding, LM head and sampling cancel), so
this compiles two shallow steps, not 48 layers. `moejax plan --target h200` prints the figures of
the whole step (docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from compile_only import lower

from moejax.base import targets
from moejax.compiled import plan
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset

LAUNCHES_PER_LAYER = 16
DEPTHS = (2, 3)
BATCHES = (1, 64)
FORMATS = ("unquantized", "nvfp4")


@functools.cache
def step(batch: int, fmt: str, layers: int) -> dict:
    """`plan.decode_kernels` of Qwen3-30B-A3B's decode step (`layers` deep) over pages of 16 for one H200."""
    model = dataclasses.replace(preset("qwen3-moe-30b-a3b"), num_layers=layers)
    config = Config(
        model=model,
        layout=LayoutConfig(devices=1),
        weights=WeightsConfig(fmt),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()
    devices = list(targets.devices("h200", 1))
    placement, programs = plan.programs(config, batch, 4096, 512, "cuda", devices, 16)
    jitted, args = programs["decode"]
    assert placement.decode.fuses(batch)  # the decode kernels, as a GPU's run takes them
    return plan.decode_kernels(lower(jitted, *args).compile().as_text(), args[0], layers)


def per_layer(batch: int, fmt: str) -> dict[str, float]:
    """A layer's launches by kind: the deeper step's less the shallower's."""
    shallow, deep = (step(batch, fmt, n)["launch_kinds"] for n in DEPTHS)
    kinds = {kind: (deep.get(kind, 0) - shallow.get(kind, 0)) / (DEPTHS[1] - DEPTHS[0]) for kind in deep | shallow}
    return {kind: n for kind, n in kinds.items() if n}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_a_decode_layer_launches_few_kernels(batch, fmt):
    """A layer's launches: its kernels (the fused projections, router and experts, each a Triton
    kernel; the paged attention, our Mosaic GPU kernel) and a few XLA fusions, at most
    LAUNCHES_PER_LAYER."""
    kinds = per_layer(batch, fmt)
    triton = kinds.get("custom-call __gpu$xla.gpu.triton", 0)
    assert triton >= 5, kinds  # q|k|v, output, router, gate_up, down: what it counted
    assert kinds.get("custom-call mosaic_gpu_v2") == 1, kinds  # the paged attention
    assert sum(kinds.values()) <= LAUNCHES_PER_LAYER, kinds


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_a_decode_step_writes_no_temporary_of_a_weights_shape(batch, fmt):
    """No op of the step writes an array of a layer weight's shape, whatever the depth; the launches
    it looked through are the step's."""
    for layers in DEPTHS:
        kernels = step(batch, fmt, layers)
        assert kernels["launches"] > 5 * layers  # each layer's kernels
        assert kernels["weight_shaped"] == 0, kernels
