"""The engine's programs compiled by the accelerators' own compilers, on this CPU machine.

Every family (the tiny presets, the goldens' transformers models, and models whose widths are no
power of two) x paged decode step x bfloat16 and float32 (and float32's decode step and prefill
chunk over a contiguous cache), with the kernels `auto` picks (and the XLA path's in bf16), compile
for an H100 (XLA:GPU with its Triton and Mosaic GPU lowerings); every family's decode step and
prefill chunk compile for an H100 and a B200 as by a jax without Pallas's Triton backend,
raising no deprecation warning; every placement's decode step and prefill chunk compile for 8 H100s
and for a v5e slice of 8 chips with the Pallas kernels the target's `auto` picks. The whole matrix
compiles once, in worker processes running side by side (`target_compiles.py`), so that an XLA
abort fails its case instead of ending the run.
"""

from __future__ import annotations

import pytest
from hf_reference import FAMILIES
from target_compiles import ODD_GQA, ODD_MLA, TILEABLE, Case, model_config, run_cases

from moejax.base.platform import resolve
from moejax.config import Config, ConfigError, LayoutConfig, WeightsConfig
from moejax.config.presets import PRESETS
from sharding import names
from sharding.placement import gemm_kernel

TPU = resolve("tpu")

# Every family once: the goldens' transformers models (the ones that met a GPU first), then a tiny
# preset of each family they lack; and GQA and MLA models of widths no power of two divides.
TINY = {model.family: name for name, model in reversed(PRESETS.items()) if name.startswith("tiny")}
MODELS = (
    [(f"hf:{family}", ()) for family in FAMILIES]
    + [(name, ()) for family, name in TINY.items() if family not in FAMILIES]
    + [("tiny-qwen3-moe", ODD_GQA), ("tiny", ODD_MLA)]
)
DTYPES = ("bfloat16", "float32")
STEP_AND_CHUNK = ("decode", "prefill")
PAGE_SIZE = 16

# The decode step and the prefill chunk over a contiguous cache (float32), the decode step over pages
# (a decode block is the decode step in a loop: `test_target_structure.py` compiles it); the XLA
# path's own expert products in bf16 (its float32 dots are the auto path's, and the expert einsums'),
# without pages (`XLA_ONLY` reads pages through XLA).
FAMILY_CASES = [
    case
    for model, widths in MODELS
    for dtype in DTYPES
    for case in (
        *([Case(model, "h100", widths, dtype=dtype, programs=STEP_AND_CHUNK)] if dtype == "float32" else []),
        Case(model, "h100", widths, dtype=dtype, page_size=PAGE_SIZE, programs=("decode",)),
        *([Case(model, "h100", widths, kernel="xla", programs=STEP_AND_CHUNK)] if dtype == "bfloat16" else []),
    )
]
# Every family's decode step and prefill chunk over pages, as a jax without Pallas's Triton backend
# compiles them (jax 0.11 deprecated it) for a Hopper and a Blackwell GPU with `auto`; and 4-bit
# experts wide enough for the Blackwell bf16 x 4-bit kernel. (A decode block is its step in a loop:
# `test_target_structure.py` compiles it and reads its loop.)
GPU_ARCHITECTURES = {"h100": "mosaic_gpu", "b200": "blackwell_bf16"}
WITHOUT_TRITON = [
    Case(model, target, widths, page_size=PAGE_SIZE, programs=STEP_AND_CHUNK, triton=False)
    for model, widths in MODELS
    for target in GPU_ARCHITECTURES
] + [
    Case(
        "tiny-qwen3-moe",
        target,
        TILEABLE,
        expert_format="nvfp4",
        page_size=PAGE_SIZE,
        programs=STEP_AND_CHUNK,
        triton=False,
    )
    for target in GPU_ARCHITECTURES
]
# 4-bit experts on widths the TPU grouped GEMM tiles; pages, for the paged-attention kernels.
TARGET_DEVICES = {"h100": 8, "v5e": 8}
PLACEMENT_CASES = [
    Case(
        "tiny-qwen3-moe",
        target,
        TILEABLE,
        devices=n,
        placement=name,
        expert_format="nvfp4",
        page_size=PAGE_SIZE,
        programs=STEP_AND_CHUNK,
    )
    for target, n in TARGET_DEVICES.items()
    for name in names()
]
# The grouped GEMM `auto` picks for each target's 4-bit experts in bf16, and the Pallas custom calls
# its programs' experts run in: on a GPU a pass of at most 128 rows (a decode step's, these small
# prefill chunks') in the fused decode kernels (Triton's), more rows in the Mosaic GPU grouped GEMM.
KERNEL = {"h100": "mosaic_gpu", "v5e": "pallas_tpu"}
KERNEL_CALLS = {"h100": ("mosaic_gpu", "triton"), "v5e": ("mosaic_tpu",)}
# 4-bit experts sliced narrower than the TPU grouped GEMM tiles (K 64 a device): `auto` multiplies
# them through XLA (Mosaic refused the program: GLM-5.3 tensor-sliced over 32 v6e chips).
NARROW = Case(
    "tiny-qwen3-moe",
    "v5e",
    (("hidden_size", 512), ("moe_intermediate_size", 512)),
    devices=8,
    placement="tensor_sliced",
    expert_format="nvfp4",
    programs=("decode",),
)
XLA_ONLY = Case(
    "tiny-qwen3-moe", "h100", kernel="xla", attention_kernel="xla", page_size=PAGE_SIZE, programs=("decode",)
)


@pytest.fixture(scope="session")
def compiled() -> dict[str, dict]:
    return run_cases(FAMILY_CASES + WITHOUT_TRITON + PLACEMENT_CASES + [NARROW, XLA_ONLY])


def _programs(result: dict) -> dict:
    assert "aborted" not in result, f"the compiler aborted: {result['aborted']}"
    failed = {name: p["error"] for name, p in result["programs"].items() if not p["compiled"]}
    assert not failed, failed
    return result["programs"]


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c.id)
def test_every_family_compiles_for_an_h100(compiled, case):
    programs = _programs(compiled[case.id])
    assert set(programs) == set(case.programs)


@pytest.mark.parametrize("case", PLACEMENT_CASES, ids=lambda c: c.id)
def test_every_placement_compiles_for_a_target_with_its_kernels(compiled, case):
    result = compiled[case.id]
    programs = _programs(result)
    assert result["kernel"] == KERNEL[case.target]
    for name, program in programs.items():
        assert set(KERNEL_CALLS[case.target]) & set(program["pallas_calls"]), name
    # The pages' attention kernel: the decode step reads them through it where auto picks one.
    assert programs["decode"]["paged_attention"] == (result["attention_kernel"] != "xla")
    if case.placement == "ragged_a2a":  # the exchange is the target's own ragged all-to-all
        assert all(p["ragged_all_to_all"] for p in programs.values())


@pytest.mark.parametrize("case", WITHOUT_TRITON, ids=lambda c: c.id)
def test_every_family_compiles_for_hopper_and_blackwell_without_triton(compiled, case):
    result = compiled[case.id]
    programs = _programs(result)
    assert set(programs) == set(case.programs)
    # The fused decode kernels: Mosaic GPU's on a Hopper where they take the widths, else XLA's ops.
    assert result["decode_kernels"] in (("mosaic_gpu", "xla") if case.target == "h100" else ("xla",))
    for name, program in programs.items():
        assert "triton" not in program["pallas_calls"], name
        assert program["deprecations"] == [], name
    if case.expert_format == "nvfp4":  # `auto` picks the architecture's Mosaic GPU kernel
        assert result["kernel"] == GPU_ARCHITECTURES[case.target]
        assert all("mosaic_gpu" in p["pallas_calls"] for p in programs.values())


def test_the_xla_path_compiles_no_pallas_kernel(compiled):
    program = _programs(compiled[XLA_ONLY.id])["decode"]
    assert program["pallas_calls"] == [] and not program["paged_attention"]


def test_auto_multiplies_experts_the_tpu_kernel_cannot_tile_through_xla(compiled):
    result = compiled[NARROW.id]
    assert _programs(result) and result["kernel"] == "xla"


def test_the_tpu_kernel_named_for_experts_it_cannot_tile_is_refused_with_the_reason():
    config = Config(
        model=model_config(NARROW), layout=LayoutConfig(devices=8), weights=WeightsConfig("nvfp4"), kernel="pallas_tpu"
    ).validate()
    assert gemm_kernel(config, TPU, 1) == "pallas_tpu"  # K 512 and 512 on one device
    with pytest.raises(
        ConfigError,
        match=r"kernel pallas_tpu: 4-bit experts need a K per device of a multiple "
        r"of 256, these have 64; these experts multiply through XLA",
    ):
        gemm_kernel(config, TPU, 8)
