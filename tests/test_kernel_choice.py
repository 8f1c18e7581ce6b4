"""Which grouped GEMM and paged attention a run's `auto` stands for: by platform, GPU architecture,
run dtype, expert format and widths, and this jax's Pallas backends (a jax without Triton: jax 0.11
deprecated it); and a kernel named for what it cannot run, refused in one line. On compile-only
devices."""

from __future__ import annotations

import dataclasses

import pytest

from moejax.base import targets
from moejax.base.platform import resolve
from moejax.compiled import hlo, plan
from moejax.config import Config, ConfigError, EngineConfig, LayoutConfig, WeightsConfig, preset
from pallas_kernels import probes
from sharding import make_placement

GPU = resolve("cuda")
WIDE = {"hidden_size": 512, "moe_intermediate_size": 256}  # the Blackwell bf16 x 4-bit kernel's least tiles


def _placement(target: str, *, dtype="bfloat16", fmt="unquantized", kernel="auto", wide=True, attention="auto"):
    model = preset("tiny-qwen3-moe")
    model = dataclasses.replace(model, **WIDE) if wide else model
    config = Config(
        model=model,
        layout=LayoutConfig(devices=1),
        weights=WeightsConfig(fmt),
        engine=EngineConfig(dtype=dtype),
        kernel=kernel,
        attention_kernel=attention,
    ).validate()
    return make_placement(config, platform=GPU, devices=list(targets.devices(target, 1)))


@pytest.fixture
def without_triton(monkeypatch):
    monkeypatch.setattr(probes, "has_triton", lambda: False)


@pytest.mark.parametrize(
    "target, dtype, fmt, wide, kernel, decode",
    [
        ("h100", "bfloat16", "unquantized", True, "mosaic_gpu", "mosaic_gpu"),
        # any width: padded; its decode set refuses widths of no whole 64-column tiles: XLA's ops, not Triton's
        ("h100", "bfloat16", "nvfp4", False, "mosaic_gpu", "xla"),
        ("h100", "float32", "unquantized", True, "triton", "triton"),  # wgmma would multiply float32 as TF32
        ("b200", "bfloat16", "mxfp4", True, "blackwell_bf16", "triton"),
        ("b200", "bfloat16", "nvfp4", False, "triton", "triton"),  # narrower than the kernel's tiles
        ("b200", "bfloat16", "unquantized", True, "triton", "triton"),  # its kernels multiply 4-bit experts
        ("a100", "bfloat16", "nvfp4", True, "triton", "triton"),  # no wgmma, no tcgen05
    ],
)
def test_auto_picks_the_architectures_mosaic_kernel_where_it_can_run(target, dtype, fmt, wide, kernel, decode):
    """And the decode set: a Hopper's Mosaic GPU one (its router a kernel too), else Triton's."""
    placement = _placement(target, dtype=dtype, fmt=fmt, wide=wide)
    assert placement.kernel == kernel
    assert placement.decode.kernel == decode
    if decode == "mosaic_gpu":
        assert placement.decode.router == "mosaic_gpu_router" and placement.decode.linear == "mosaic_gpu_linear"


@pytest.mark.parametrize(
    "target, dtype, fmt, kernel, decode",
    [
        ("h100", "bfloat16", "nvfp4", "mosaic_gpu", "mosaic_gpu"),
        ("h100", "float32", "unquantized", "xla", "xla"),
        ("b200", "bfloat16", "nvfp4", "blackwell_bf16", "xla"),
        ("b200", "bfloat16", "unquantized", "xla", "xla"),
    ],
)
def test_without_triton_auto_never_picks_a_triton_kernel(without_triton, target, dtype, fmt, kernel, decode):
    """Nor a Triton decode set: a Hopper's bf16 decode steps take Mosaic GPU's (its dense products
    and its router kernel), else XLA's ops."""
    placement = _placement(target, dtype=dtype, fmt=fmt)
    assert placement.kernel == kernel and placement.decode.kernel == decode
    if decode == "mosaic_gpu":
        assert placement.decode.linear == "mosaic_gpu_linear" and placement.decode.topk is None
        assert placement.decode.router == "mosaic_gpu_router"
        # not the float32 router's product (the router kernel's), nor this model's attention: heads of
        # 16 columns, no whole swizzled tile
        assert placement.decode.dense == {"mlp", "shared_mlp"}


@pytest.mark.parametrize(
    "target, kernel, fmt, match",
    [
        (
            "b200",
            "mosaic_gpu",
            "unquantized",
            r"kernel mosaic_gpu: needs an NVIDIA Hopper \(sm_90\) GPU; this one is sm_100",
        ),
        ("h100", "blackwell_bf16", "nvfp4", r"kernel blackwell_bf16: needs an NVIDIA Blackwell \(sm_100\) GPU"),
        ("b200", "blackwell_bf16", "unquantized", "kernel blackwell_bf16: multiplies bfloat16 rows by 4-bit experts"),
    ],
)
def test_a_kernel_named_for_another_architecture_or_format_is_refused(target, kernel, fmt, match):
    with pytest.raises(ConfigError, match=match):
        _placement(target, fmt=fmt, kernel=kernel)


@pytest.mark.parametrize("target, attention", [("a100", "xla"), ("h100", "mosaic_gpu"), ("b200", "mosaic_gpu")])
def test_auto_attention_is_mosaic_gpus_where_the_gpu_has_tma(target, attention):
    assert _placement(target).attention_kernel == attention


def test_an_ampere_gpus_paged_decode_step_compiles_reading_pages_through_xla():
    """The Mosaic GPU attention's TMA copies do not exist on sm_80 (its compile fails there): `auto`
    leaves an A100's pages to XLA, and the paged step compiles with Triton's kernels only."""
    config = Config(
        model=preset("tiny-qwen3-moe"), layout=LayoutConfig(devices=1), engine=EngineConfig(dtype="bfloat16")
    ).validate()
    placement, programs = plan.programs(config, 8, 64, 64, "cuda", list(targets.devices("a100", 1)), page_size=16)
    compiled, _, why = plan.compile_program(*programs["decode"], persist=False)
    assert why is None and placement.attention_kernel == "xla"
    calls = hlo.by_kind(hlo.pallas_calls(compiled.as_text()))
    assert calls and set(calls) == {"custom-call __gpu$xla.gpu.triton"}


def test_the_mosaic_gpu_attention_named_for_an_ampere_gpu_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"attention kernel mosaic_gpu: needs an NVIDIA Hopper or Blackwell GPU \(TMA\); this one is sm_80",
    ):
        _placement("a100", attention="mosaic_gpu")


def test_without_triton_the_triton_kernel_named_is_refused(without_triton):
    with pytest.raises(ConfigError, match="kernel triton: this jax .* has no Pallas Triton backend"):
        _placement("h100", kernel="triton")


def test_this_jax_has_the_triton_backend_it_is_pinned_with():
    assert probes.has_triton()


def test_a_jax_whose_mosaic_gpu_lacks_blackwells_names_falls_back_to_triton(monkeypatch):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.delattr(plgpu, "tcgen05_mma")
    assert _placement("b200", fmt="nvfp4").kernel == "triton"
    with pytest.raises(
        ConfigError,
        match=r"kernel blackwell_bf16: this jax \(.*\) lacks jax.experimental.pallas.mosaic_gpu.tcgen05_mma",
    ):
        _placement("b200", fmt="nvfp4", kernel="blackwell_bf16")


def test_auto_on_an_h100_compiles_a_model_of_odd_widths_with_no_triton_kernel():
    """Where Mosaic GPU's decode kernels refuse a model's widths (tiny-qwen3-moe: no whole 64-column
    tiles), its decode step's small products run as XLA's ops, not Triton's kernels: the step's
    Pallas calls are Mosaic GPU's alone (the grouped GEMM, the paged attention)."""
    config = Config(
        model=preset("tiny-qwen3-moe"), layout=LayoutConfig(devices=1), engine=EngineConfig(dtype="bfloat16")
    ).validate()
    placement, programs = plan.programs(config, 8, 64, 64, "cuda", list(targets.devices("h100", 1)), page_size=16)
    compiled, _, why = plan.compile_program(*programs["decode"], persist=False)
    assert why is None and placement.kernel == "mosaic_gpu" and placement.decode.kernel == "xla"
    calls = hlo.by_kind(hlo.pallas_calls(compiled.as_text()))
    assert calls and set(calls) == {"custom-call mosaic_gpu_v2"}, calls
