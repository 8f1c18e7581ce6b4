"""The shape of a GPU's decode step at full width: Qwen3-30B-A3B's decode step compiled for a
compile-only H200 (XLA:GPU's own compiler, `moejax.base.targets`), at batch 1 and 64, with bf16 and
NVFP4 experts. A layer launches at most LAUNCHES_PER_LAYER kernels and writes no temporary of a
layer weight's shape (a weight copied, or a product spelled out as a multiply the weight's size
and a reduce), read off the compiled program by `moejax.compiled.hlo`. At batch 1 on an H100, H200
and B200, every decode kernel of Qwen3-30B-A3B's and GLM-5.3's steps that streams weights runs at
least a program per SM.

A GPU runs every layer unrolled, each layer the same kernels: a layer's figures are the difference
of the steps of DEPTHS[1] and DEPTHS[0] layers (the embedding, LM head and sampling cancel), so
this compiles two shallow steps, not 48 layers. `moejax plan --target h200` prints the figures of
the whole step (docs/benchmarks.md)."""

from __future__ import annotations

import collections
import dataclasses
import functools
from unittest import mock

import pytest
from compile_only import lower

from moejax.base import targets
from moejax.compiled import plan
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from pallas_kernels import probes

LAUNCHES_PER_LAYER = 16
DEPTHS = (2, 3)
BATCHES = (1, 64)
FORMATS = ("unquantized", "nvfp4")


FILL_TARGETS = ("h100", "h200", "b200")
QWEN = "qwen3-moe-30b-a3b"
FILL_MODELS = (QWEN, "glm-5.3")  # GLM-5.3's MLA projections are Triton's only (`catalog.Kernel.latent_heads`)


@functools.cache
def step(
    batch: int, fmt: str, layers: int, target: str, name: str, attention: str = "auto", triton: bool = True
) -> dict:
    """`plan.decode_kernels` of model `name`'s decode step (`layers` deep: its first dense layer, if it
    has any, then MoE layers) over pages of 16, read through `attention` kernel, for one `target`
    device (`triton` False: a jax without Pallas's Triton backend), each Pallas kernel's figures
    (`plan.pallas_figures`) under "kernels" and the decode set the placement took under "set"."""
    if not triton:
        with mock.patch.object(probes, "has_triton", lambda: False):
            return step.__wrapped__(batch, fmt, layers, target, name, attention)
    whole = preset(name)
    model = dataclasses.replace(whole, num_layers=layers, dense_layers=whole.dense_layers[:1])
    config = Config(
        model=model,
        layout=LayoutConfig(devices=1),
        weights=WeightsConfig(fmt),
        engine=EngineConfig(dtype="bfloat16"),
        attention_kernel=attention,
    ).validate()
    devices = list(targets.devices(target, 1))
    placement, programs = plan.programs(config, batch, 4096, 512, "cuda", devices, 16)
    jitted, args = programs["decode"]
    assert placement.decode.fuses(batch)  # the decode kernels, as a GPU's run takes them
    text = lower(jitted, *args).compile().as_text()
    figures = plan.pallas_figures(text, targets.target(target))
    return {**plan.decode_kernels(text, args[0], layers), "kernels": figures, "set": placement.decode.kernel}


def per_layer(batch: int, fmt: str) -> dict[str, float]:
    """A layer's launches by kind: the deeper step's less the shallower's."""
    shallow, deep = (step(batch, fmt, n, "h200", QWEN)["launch_kinds"] for n in DEPTHS)
    kinds = {kind: (deep.get(kind, 0) - shallow.get(kind, 0)) / (DEPTHS[1] - DEPTHS[0]) for kind in deep | shallow}
    return {kind: n for kind, n in kinds.items() if n}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_a_decode_layer_launches_few_kernels(batch, fmt):
    """A layer's launches: its kernels (the fused projections, router, experts and paged attention,
    each a Mosaic GPU kernel: a Hopper's `auto`) and a few XLA fusions, at most LAUNCHES_PER_LAYER."""
    kinds = per_layer(batch, fmt)
    assert "custom-call __gpu$xla.gpu.triton" not in kinds, kinds
    # q|k|v, output, the router's two launches, gate_up, down, the paged attention: what it counted
    assert kinds.get("custom-call mosaic_gpu_v2", 0) >= 7, kinds
    assert sum(kinds.values()) <= LAUNCHES_PER_LAYER, kinds


@pytest.mark.parametrize("batch", BATCHES)
def test_without_triton_a_hopper_decode_step_runs_its_products_in_mosaic_gpu_kernels(batch):
    """A jax without Pallas's Triton backend: the H200 step multiplies its experts by pick, q|k|v,
    the output projection and the router (norm, float32 logits, top-k: `route_mgpu`, split over D
    and summed by a second launch) in Mosaic GPU kernels, calls no Triton kernel of ours, launches at
    most LAUNCHES_PER_LAYER kernels a layer and writes no temporary of a weight's shape (XLA's router
    was 7 launches and the [D, E] float32 product: 20 launches a layer at batch 1, 17 at 64)."""
    steps = [step(batch, "unquantized", n, "h200", QWEN, triton=False) for n in DEPTHS]
    calls = collections.Counter()
    for f in steps[0]["kernels"]:
        calls[f["kernel"]] += f["calls"]
    # q|k|v and the output projection (at batch 1 each split over K: two calls), the two pick GEMMs,
    # the router's two launches, a layer
    assert calls["linear_mgpu"] >= 3 * DEPTHS[0] and calls["pick_gemm_mgpu"] == 2 * DEPTHS[0], calls
    assert calls["route_mgpu"] == 2 * DEPTHS[0], calls
    shallow, deep = (s["launch_kinds"] for s in steps)
    assert "custom-call __gpu$xla.gpu.triton" not in deep, deep
    assert 0 < sum(deep.values()) - sum(shallow.values()) <= LAUNCHES_PER_LAYER * (DEPTHS[1] - DEPTHS[0])
    assert [s["weight_shaped"] for s in steps] == [0, 0], steps


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", BATCHES)
def test_a_decode_step_writes_no_temporary_of_a_weights_shape(batch, fmt):
    """No op of the step writes an array of a layer weight's shape, whatever the depth; the launches
    it looked through are the step's."""
    for layers in DEPTHS:
        kernels = step(batch, fmt, layers, "h200", QWEN)
        assert kernels["launches"] > 5 * layers  # each layer's kernels
        assert kernels["weight_shaped"] == 0, kernels


def launch_bound(f: dict, target: str) -> bool:
    """Whether a kernel's programs read their bytes (`plan.pallas_figures`'s figures `f`) within a
    launch gap even at one SM's share of the bandwidth each: short of the SMs, it idles none for
    long (a top-k over a row of logits, the sum of a split product's partials)."""
    t = targets.target(target)
    return f["bytes"] / (f["programs"] * t.hbm_tb_s * 1e12 / t.cores) * 1e6 < t.launch_us


@pytest.mark.parametrize("name", FILL_MODELS)
@pytest.mark.parametrize("target", FILL_TARGETS)
def test_every_decode_kernel_fills_the_gpu_at_batch_1(target, name):
    """At batch 1 each decode kernel (Mosaic GPU's on Hopper, else Triton's) runs at least as many
    programs as the target has SMs (`Target.cores`), but those that are launch-bound: q|k|v, the
    output projection and the router split K where their column tiles are too few (Hopper's router
    over D). A grid does not depend on depth: the shallow step's.
    These steps read pages through XLA: Mosaic GPU's ptxas keeps the first architecture a process
    compiles for (a B200 attention after an H100 one fails in one test process, as
    `tests/target_compiles.py`'s workers are grouped for); the attention's is the next test's."""
    found = step(1, "unquantized", DEPTHS[0], target, name, attention="xla")
    figures = found["kernels"]
    if target == "b200":  # no sm_100 Mosaic GPU decode kernels: Triton's, named by their scopes
        wanted = {"qkv", "out", "router", "experts"} if name == QWEN else {"latent", "out", "mlp", "router", "experts"}
        assert found["set"] == "triton" and wanted <= {f["kernel"].split()[0] for f in figures}, figures
    else:  # Mosaic GPU's, named by module: its distinct calls (a split product's combine one more)
        calls = collections.Counter(f["kernel"] for f in figures)
        # q|k|v and the output projection (GLM-5.3: the dense MLP's and the shared experts' products)
        # in linear_mgpu, the router in route_mgpu, gate_up and down in pick_gemm_mgpu
        wanted = {"linear_mgpu": 2, "route_mgpu": 1, "pick_gemm_mgpu": 2}
        assert found["set"] == "mosaic_gpu" and all(calls[k] >= n for k, n in wanted.items()), figures
    assert [f for f in figures if f["programs"] < f["sms"] and not launch_bound(f, target)] == []


def test_the_paged_attention_fills_the_gpu_at_batch_1():
    """The H200 step's paged attention (our Mosaic GPU kernel, its grid read off the program) at batch
    1 of 4 kv heads runs a CTA per SM at least: its splits cover the SMs (`gpu_blocks`), the
    combine a loop over them."""
    figures = step(1, "unquantized", DEPTHS[0], "h200", QWEN)["kernels"]
    attention = [f for f in figures if f["kernel"].startswith("paged_attention")]
    assert len(attention) == 1, figures
    assert attention[0]["programs"] >= attention[0]["sms"], attention
