"""What differs by platform is decided in moejax.platform, for this machine or a named target."""

import os

import numpy as np
import pytest

from moejax import platform
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from sharding import make_placement
from sharding.placement import GEMM_WEIGHTS


def test_auto_dtype_is_float32_on_the_cpu_reference():
    """The default run dtype: bfloat16 on accelerators, float32 on XLA:CPU (the goldens' dtype)."""
    assert EngineConfig().dtype == "auto"
    assert platform.run_dtype("auto") == "float32" and platform.backend() == "cpu"
    assert platform.run_dtype("auto", "tpu") == platform.run_dtype("auto", "gpu") == "bfloat16"
    assert platform.run_dtype("bfloat16") == "bfloat16"


def test_auto_unrolls_short_runs_of_layers_on_the_cpu_only():
    """Unrolled, compile time grows with depth: a 78-layer run keeps its scan."""
    assert platform.unrolls("auto", 4) and platform.unrolls("auto", platform.UNROLLED_LAYERS)
    assert not platform.unrolls("auto", 78) and not platform.unrolls("auto", 4, "tpu")
    assert platform.unrolls("unroll", 78) and not platform.unrolls("scan", 4)


def test_decode_programs_leave_ynn_fusions_on_the_cpu_only():
    """A decode program's compiler options: XLA:CPU's YNN fusions off; other platforms keep
    XLA's defaults (as every prefill does: it is compiled without options)."""
    for dtype in ("float32", "bfloat16"):
        assert platform.compiler_options(dtype, decode=True) == {"xla_cpu_experimental_ynn_fusion_type": ""}
        assert platform.compiler_options(dtype) is None
    assert platform.compiler_options("bfloat16", decode=True, platform="tpu") is None


def test_float32_programs_merge_no_dots_on_xla_gpu():
    """XLA:GPU's dot merger sets up a Triton GEMM fusion that aborts the compiler in float32
    (the tests' tiny DeepSeek-V3, test_precision.py): every program of a float32 run goes without it."""
    for gpu in ("gpu", "cuda"):
        for decode in (False, True):
            assert platform.compiler_options("float32", decode, gpu) == {"xla_gpu_dot_merger_threshold_mb": 0}
        assert platform.compiler_options("bfloat16", True, gpu) is None
    assert platform.compiler_options("float32", platform="tpu") is None


def test_float32_means_full_precision_products_and_bf16_the_platforms_default():
    assert platform.matmul_precision("float32") == platform.matmul_precision(np.dtype("float32")) == "highest"
    assert platform.matmul_precision("bfloat16") is None


def test_prefill_chunk_default_by_platform_and_an_explicit_one_kept():
    assert platform.prefill_chunk(0) == 1024 and platform.prefill_chunk(0, "gpu") == 512
    assert platform.prefill_chunk(64, "gpu") == 64


@pytest.mark.parametrize("target, kernel", [("cpu", "xla"), ("tpu", "pallas_tpu"), ("cuda", "pallas_gpu")])
def test_a_placement_resolves_auto_for_the_platform_it_builds_for(target, kernel):
    """A program compiled for a target (`moejax plan --target`) gets its target's kernel, not this machine's."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(devices=1)).validate()
    assert make_placement(config, platform=target).kernel == kernel


@pytest.mark.parametrize("target, stacked, ragged", [("cpu", False, False), ("tpu", True, True), ("gpu", False, True)])
def test_a_placement_runs_layers_and_the_exchange_as_its_platform_does(target, stacked, ragged):
    """Runs of layers unrolled on XLA:CPU (short ones) and on a GPU, scanned on a TPU; the
    exchange's dense blocks on XLA:CPU only; decided for the platform the programs are built for."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement="ragged_a2a", devices=2)).validate()
    placement = make_placement(config, platform=target)
    assert [loop.stacked for loop in placement.loops] == [stacked] * len(placement.loops)
    assert placement.use_ragged == ragged


@pytest.mark.parametrize(
    "name, target, groups",
    [("tensor_sliced", "cpu", GEMM_WEIGHTS), ("expert_sharded", "cpu", ()), ("tensor_sliced", "tpu", None)],
)
def test_unrolled_experts_a_buffer_per_group_where_every_device_holds_every_expert_on_the_cpu(name, target, groups):
    """XLA:CPU copies a group sliced out of a stack: a placement that keeps every expert on every
    device holds an unrolled run's experts a buffer per group; one that splits them over devices
    keeps its stacks, and a scanned run (a TPU's) has none to split."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement=name, devices=2)).validate()
    placement = make_placement(config, platform=target)
    assert [getattr(loop, "groups", None) for loop in placement.loops] == [groups] * len(placement.loops)


def test_a_gpu_unrolled_run_keeps_a_layers_expert_stack_even_for_the_xla_kernel():
    """A GPU runs its layers unrolled but never holds a buffer per expert group: the XLA kernel's
    switch between groups would read its branch index back to the host."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement="tensor_sliced", devices=2), kernel="xla")
    placement = make_placement(config.validate(), platform="gpu")
    assert [(loop.stacked, loop.groups) for loop in placement.loops] == [(False, ())] * len(placement.loops)


def test_host_cores_without_an_affinity_mask(monkeypatch):
    """macOS has no os.sched_getaffinity: the core count stands in."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert platform.host_cores() == 3
