"""What differs by platform is decided in moejax.base.platform, for this machine or a named target."""

import functools
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from moejax.base import platform
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from pallas_kernels import catalog
from pallas_kernels.catalog import ATTENTION, GEMM
from sharding import make_placement
from sharding.placement import GEMM_WEIGHTS

ROOT = Path(__file__).resolve().parent.parent
CPU, GPU, TPU = (platform.resolve(name) for name in platform.PLATFORMS)


def test_this_machine_is_the_cpu_and_a_gpu_has_one_name():
    """The tests run on XLA:CPU; jax's two names of a GPU ("gpu", a compile target's "cuda") make
    one record, and a name jax has not is refused."""
    assert platform.resolve() is CPU and platform.resolve("cuda") is platform.resolve("gpu") is GPU
    with pytest.raises(ValueError, match="unknown platform 'rocm'"):
        platform.resolve("rocm")


def test_auto_dtype_is_float32_on_the_cpu_reference():
    """The default run dtype: bfloat16 on accelerators, float32 on XLA:CPU (the goldens' dtype)."""
    assert EngineConfig().dtype == "auto"
    assert platform.run_dtype("auto") == CPU.run_dtype("auto") == "float32"
    assert TPU.run_dtype("auto") == GPU.run_dtype("auto") == platform.run_dtype("auto", "cuda") == "bfloat16"
    assert CPU.run_dtype("bfloat16") == "bfloat16"


def test_auto_unrolls_short_runs_of_layers_on_the_cpu_and_every_run_on_a_gpu():
    """Unrolled, compile time grows with depth: a 78-layer run keeps its scan on XLA:CPU."""
    assert CPU.unrolls("auto", 4) and CPU.unrolls("auto", CPU.unrolled_layers)
    assert not CPU.unrolls("auto", 78) and GPU.unrolls("auto", 78) and not TPU.unrolls("auto", 4)
    assert CPU.unrolls("unroll", 78) and not GPU.unrolls("scan", 4)


def test_decode_programs_leave_ynn_fusions_on_the_cpu_only():
    """A decode program's compiler options: XLA:CPU's YNN fusions off; a TPU keeps XLA's defaults
    (as every prefill does: it is compiled without options)."""
    for dtype in ("float32", "bfloat16"):
        assert CPU.compiler_options(dtype, decode=True) == {"xla_cpu_experimental_ynn_fusion_type": ""}
        assert CPU.compiler_options(dtype) is None
    assert TPU.compiler_options("bfloat16", decode=True) is None


def test_gpu_decode_programs_run_as_cuda_graphs_of_every_kernel_and_loop():
    """A GPU's decode programs record every kernel kind, loops and conditionals among them, into
    command buffers, however short a run; its prefills keep XLA's defaults."""
    options = GPU.compiler_options("bfloat16", decode=True)
    kinds = set(options["xla_gpu_enable_command_buffer"].split(","))
    assert {"FUSION", "CUSTOM_CALL", "WHILE", "CONDITIONAL"} <= kinds and options["xla_gpu_graph_min_graph_size"] == 1
    assert GPU.compiler_options("bfloat16") is None


def test_float32_programs_merge_no_dots_on_xla_gpu():
    """XLA:GPU's dot merger sets up a Triton GEMM fusion that aborts the compiler in float32
    (the tests' tiny DeepSeek-V3, test_precision.py): every program of a float32 run goes without it."""
    for decode in (False, True):
        assert GPU.compiler_options("float32", decode)["xla_gpu_dot_merger_threshold_mb"] == 0
    assert "xla_gpu_dot_merger_threshold_mb" not in GPU.compiler_options("bfloat16", True)
    assert TPU.compiler_options("float32") is None


def test_float32_means_full_precision_products_and_bf16_the_platforms_default():
    assert CPU.matmul_precision("float32") == GPU.matmul_precision(np.dtype("float32")) == "highest"
    assert TPU.matmul_precision("bfloat16") is None


def test_prefill_chunk_default_by_platform_and_an_explicit_one_kept():
    assert platform.prefill_chunk(0) == CPU.prefill_chunk == 1024 and platform.prefill_chunk(0, "cuda") == 512
    assert platform.prefill_chunk(64, "gpu") == 64


@pytest.mark.parametrize(
    "record, rows, quantized, way",
    [
        (CPU, 16, False, "gather"),  # a decode step's few rows of unquantized experts
        (CPU, 16, True, "groups"),
        (CPU, 17, False, "groups"),
        (GPU, 128, True, "gather"),  # no loop whose trip count depends on the picks
        (TPU, 128, True, "rows"),
        (GPU, 129, False, "tiles"),
        (TPU, 129, True, "tiles"),
    ],
)
def test_the_xla_grouped_gemm_meets_its_rows_as_its_platform_runs_them(record, rows, quantized, way):
    assert record.gemm_rows(rows, quantized) == way


def test_the_cpus_rows_through_the_xla_grouped_gemm_are_the_product():
    """XLA:CPU's way for a decode step's rows (one batched product of each row's gathered expert),
    handed to the kernel as its decision: the product of the rows by their groups."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 32, 16)), jnp.float32)
    sizes = jnp.asarray([3, 0, 5, 4], jnp.int32)
    out = pk.grouped_gemm(lhs, rhs, sizes, gemm_rows=CPU.gemm_rows, precision=CPU.matmul_precision("float32"))
    groups = np.repeat(np.arange(4), np.asarray(sizes))
    want = np.einsum("mk,mkn->mn", np.asarray(lhs), np.asarray(rhs)[groups])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "role, kernel, record, refusal",
    [
        (GEMM, "pallas_tpu", CPU, "needs a TPU; this machine's backend is cpu (kernel interpret_tpu"),
        (GEMM, "blackwell", TPU, "needs an NVIDIA Blackwell"),
        (GEMM, "triton", GPU, None),
        (GEMM, "interpret_triton", CPU, None),
        (ATTENTION, "mosaic_gpu", TPU, "needs an NVIDIA Hopper or Blackwell GPU (TMA); this machine's backend is tpu"),
        (ATTENTION, "pallas_tpu", TPU, None),
    ],
)
def test_a_kernel_runs_on_the_platform_it_is_compiled_for(role, kernel, record, refusal):
    found = catalog.kernel(role, kernel).why_not(record.name)
    assert found == refusal if refusal is None else found.startswith(refusal)


def test_the_page_pool_default_is_positions_on_the_cpu_and_free_memory_on_accelerators():
    assert CPU.kv_cache_tokens == platform.KV_CACHE_TOKENS["cpu"] and GPU.kv_cache_tokens is TPU.kv_cache_tokens is None


@pytest.mark.parametrize("target, kernel", [("cpu", "xla"), ("tpu", "pallas_tpu"), ("cuda", "triton")])
def test_a_placement_resolves_auto_for_the_platform_it_builds_for(target, kernel):
    """A program compiled for a target (`moejax plan --target`) gets its target's kernel, not this machine's."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(devices=1)).validate()
    placement = make_placement(config, platform=platform.resolve(target))
    assert placement.kernel == kernel and placement.platform is platform.resolve(target)


@pytest.mark.parametrize("target, stacked, ragged", [("cpu", False, False), ("tpu", True, True), ("gpu", False, True)])
def test_a_placement_runs_layers_and_the_exchange_as_its_platform_does(target, stacked, ragged):
    """Runs of layers unrolled on XLA:CPU (short ones) and on a GPU, scanned on a TPU; the
    exchange's dense blocks on XLA:CPU only; decided for the platform the programs are built for."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement="ragged_a2a", devices=2)).validate()
    placement = make_placement(config, platform=platform.resolve(target))
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
    placement = make_placement(config, platform=platform.resolve(target))
    assert [getattr(loop, "groups", None) for loop in placement.loops] == [groups] * len(placement.loops)


def test_a_gpu_unrolled_run_keeps_a_layers_expert_stack_even_for_the_xla_kernel():
    """A GPU runs its layers unrolled but never holds a buffer per expert group: the XLA kernel's
    switch between groups would read its branch index back to the host."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement="tensor_sliced", devices=2), kernel="xla")
    placement = make_placement(config.validate(), platform=GPU)
    assert [(loop.stacked, loop.groups) for loop in placement.loops] == [(False, ())] * len(placement.loops)


def test_host_cores_without_an_affinity_mask(monkeypatch):
    """macOS has no os.sched_getaffinity: the core count stands in."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert platform.host_cores() == 3


# A platform's name compared: `== "gpu"`, `!= 'cpu'`, `in ("gpu", "cuda")`, `not in (...)`.
NAME = r"""["'](?:cpu|gpu|cuda|tpu)["']"""
COMPARED = re.compile(rf"""(?:[!=]=\s*{NAME}|{NAME}\s*[!=]=|\bin\s*[(\[{{][^)\]}}]*{NAME})""")
# The two modules that may: the decisions, and the compile targets' own platforms.
DECIDERS = {"moejax/base/platform.py", "moejax/base/targets.py"}
# advise's `--target cpu`: the name of a target (this host's measured cost table), not a platform's.
TARGET_NAME = re.compile(r'\bargs\.target\s*!=\s*"cpu"')


@functools.cache
def sources() -> dict:
    """Each Python source of the project's packages, by path from the repository root."""
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for top in ("moejax", "sharding", "pallas_kernels", "checkpoints")
        for path in sorted((ROOT / top).rglob("*.py"))
    }


def test_the_grep_finds_a_platform_name_compared():
    """The pattern the next test greps with finds each way of comparing, and the deciders' own."""
    for line in ('if x == "cpu":', "y = 'tpu' != name", 'if name in ("gpu", "cuda"):', "z = p not in ['cuda']"):
        assert COMPARED.search(line) and not TARGET_NAME.search(line), line
    assert not COMPARED.search('devices(backend="cpu")') and not COMPARED.search('target = args.target or "cpu"')
    assert all(COMPARED.search(sources()[path]) for path in DECIDERS)


def test_no_platform_name_is_compared_outside_the_platform_module():
    """Every platform decision is `moejax.base.platform`'s: no other module of the project compares a
    platform's name (a placement, kernel or engine asks its `Platform` record instead)."""
    files = sources()
    assert len(files) > 100 and DECIDERS <= set(files)  # what it looked through: every package's modules
    found = [
        f"{path}:{n}: {line.strip()}"
        for path, text in files.items()
        if path not in DECIDERS
        for n, line in enumerate(text.splitlines(), 1)
        if COMPARED.search(line) and not TARGET_NAME.search(line)
    ]
    assert not found, found
