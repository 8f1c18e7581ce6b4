"""The accelerators a program can be compiled for on any machine: one table of targets, and
compile-only devices of each.

jax's CUDA PJRT plugin compiles for an NVIDIA GPU without one (no CUDA libraries, no driver) when
handed the GPU's description, an XLA `GpuTargetConfig` text proto made here from the table; libtpu
compiles for a TPU slice named by its topology ("v5e:2x4"). A jit traced with abstract arguments
sharded over such devices runs the target's whole compiler pipeline (XLA:GPU's fusion and Triton
lowering, the TPU compiler and Mosaic): its crashes, its optimized HLO and its buffer assignment
are the target's own. Nothing can run on these devices.

The figures are datasheet values (HBM bytes and bandwidth, dense peaks, per-direction link
bandwidth); a GPU's core count, clock and caches are what its driver reports. The costs a step
pays per kernel and per collective beyond its bytes (`moejax.analysis.target_pricing`) are
published or estimated figures, marked as such where they are set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os

from moejax.base.errors import UsageError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "cuda" | "tpu": the jax platform the programs are built for
    device_kind: str
    hbm_gb: float  # memory per device
    hbm_tb_s: float  # memory bandwidth per device
    bf16_tflops: float  # dense
    fp4_tflops: float  # dense; 0: no 4-bit matrix unit (4-bit weights are decoded to bf16)
    link_gb_s: float  # per device and direction: NVLink, or the ICI links' sum
    launch_us: float  # fixed cost of each kernel beyond its bytes and flops
    collective_us: float  # fixed cost of each collective beyond its bytes
    # GPUs: compute capability, SMs, SM clock, L2 bytes, shared memory per SM and per block (opt-in).
    capability: tuple[int, int] = (0, 0)
    cores: int = 0
    clock_ghz: float = 0.0
    l2_bytes: int = 0
    smem_per_core: int = 0
    smem_per_block: int = 0
    # TPUs: the topology's chip name ("v5e"), chips per host.
    chip: str = ""
    # Compiled as this other target (its programs), priced with this one's figures: a GPU whose
    # description (SMs, clocks, caches) is not at hand here.
    compiles_as: str = ""


# Per kernel on a GPU: the gap between one kernel and the next (ESTIMATE: no datasheet gives it;
# XLA:GPU runs its kernels in CUDA graphs, which launch back to back about a microsecond apart, where
# a launch from a stream costs several).
GPU_LAUNCH_US = 1.0
# Per collective over NVLink in one host: NCCL's own tuning model (src/graph/tuning.cc, PUBLISHED):
# ring / LL base latency 3.6 us + 0.47 us per NVLink hop, 7 hops among 8 GPUs.
NVLINK_US = 7.0
# Per op on a TPU, which runs one program with no host launches: the gap between fusions (ESTIMATE).
TPU_LAUNCH_US = 0.5
# Per collective over ICI (ESTIMATE: no published figure; a few hops of about 1 us each).
ICI_US = 5.0


TARGETS = {
    t.name: t
    for t in (
        # A100 80GB SXM: no TMA, wgmma or 4-bit unit, so `auto` runs Triton's kernels and XLA's attention.
        Target(
            "a100",
            "cuda",
            "NVIDIA A100-SXM4-80GB",
            80,
            2.039,
            312,
            0,
            300,
            GPU_LAUNCH_US,
            NVLINK_US,
            (8, 0),
            108,
            1.41,
            40 << 20,
            167936,
            166912,
        ),
        Target(
            "h100",
            "cuda",
            "NVIDIA H100 80GB HBM3",
            80,
            3.35,
            989,
            0,
            450,
            GPU_LAUNCH_US,
            NVLINK_US,
            (9, 0),
            132,
            1.98,
            50 << 20,
            233472,
            232448,
        ),
        Target(
            "h200",
            "cuda",
            "NVIDIA H200",
            141,
            4.8,
            989,
            0,
            450,
            GPU_LAUNCH_US,
            NVLINK_US,
            (9, 0),
            132,
            1.98,
            50 << 20,
            233472,
            232448,
        ),
        Target(
            "b200",
            "cuda",
            "NVIDIA B200",
            180,
            8.0,
            2250,
            9000,
            900,
            GPU_LAUNCH_US,
            NVLINK_US,
            (10, 0),
            148,
            1.965,
            126 << 20,
            233472,
            232448,
        ),
        # HGX B300 datasheet per GPU (8 GPUs: 108 PF dense FP4, 36 PF sparse BF16); sm_103, compiled as a B200.
        Target(
            "b300",
            "cuda",
            "NVIDIA B300",
            288,
            8.0,
            2250,
            13500,
            900,
            GPU_LAUNCH_US,
            NVLINK_US,
            (10, 3),
            compiles_as="b200",
        ),
        Target("v5e", "tpu", "TPU v5 lite", 16, 0.819, 197, 0, 200, TPU_LAUNCH_US, ICI_US, chip="v5e"),
        Target("v6e", "tpu", "TPU v6 lite", 32, 1.64, 918, 0, 448, TPU_LAUNCH_US, ICI_US, chip="v6e"),
    )
}

# A TPU slice's chips as a 2-D torus, by count (the shapes v5e and v6e slices come in).
TPU_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GPUS_PER_HOST = 8
# What each platform's compiler needs installed here: one of the modules (the `targets` extra
# installs the first; a host's CUDA 13 plugin compiles the same), else the package named.
COMPILERS = {
    "cuda": (("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), "jax-cuda12-plugin"),
    "tpu": (("libtpu",), "libtpu"),
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise UsageError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def gpu_target_config(t: Target) -> str:
    """XLA's GpuTargetConfig text proto describing GPU `t` to its compiler."""
    major, minor = t.capability
    # sm_90a / sm_100a: the architecture-specific instructions (wgmma, tcgen05) Triton emits; an
    # Ampere GPU has none (there is no sm_80a).
    features = "ACCELERATED_FEATURES" if major >= 9 else "NONE"
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t.smem_per_core}
  shared_memory_per_block_optin: {t.smem_per_block}
  threads_per_core_limit: 2048
  core_count: {t.cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t.hbm_tb_s * 1e12)}
  l2_cache_size: {t.l2_bytes}
  clock_rate_ghz: {t.clock_ghz}
  device_memory_size: {int(t.hbm_gb * GB)}
  cuda_compute_capability {{ major: {major} minor: {minor} feature_extension: {features} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{t.device_kind}"
"""


def check_compiler(t: Target) -> None:
    """One line if this machine lacks the compiler of `t`'s platform."""
    modules, package = COMPILERS[t.platform]
    if not any(
        importlib.util.find_spec(m.split(".")[0]) is not None and importlib.util.find_spec(m) is not None
        for m in modules
    ):
        raise UsageError(
            f"target {t.name} compiles with {package}, which is not installed: pip install -e '.[targets]'"
        )


@functools.cache
def devices(name: str, n: int) -> tuple:
    """`n` compile-only devices of target `name`, in mesh order."""
    t = target(name)
    if t.compiles_as:
        return devices(t.compiles_as, n)
    check_compiler(t)
    from jax.experimental import topologies

    if t.platform == "tpu":
        if n not in TPU_SHAPES:
            raise UsageError(f"a {t.name} slice has {', '.join(map(str, TPU_SHAPES))} chips, not {n}")
        # A one-chip host for one chip; otherwise libtpu's hosts of 2x2 (v5e: 2x4 where it fits).
        extra = {"chips_per_host_bounds": (1, 1, 1)} if n == 1 else {}
        # libtpu locks the host's TPU for one process; compiling touches no TPU, and test workers
        # compile side by side.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topo = topologies.get_topology_desc(topology_name=f"{t.chip}:{TPU_SHAPES[n]}", platform="tpu", **extra)
        return tuple(topo.devices)
    if n > GPUS_PER_HOST and n % GPUS_PER_HOST:
        raise UsageError(f"{n} {t.name} GPUs: more than {GPUS_PER_HOST} come as whole hosts of {GPUS_PER_HOST}")
    hosts, per_host = (n // GPUS_PER_HOST, GPUS_PER_HOST) if n > GPUS_PER_HOST else (1, n)
    # The plugin checks this machine's CUDA libraries unless told it compiles only.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    topo = topologies.get_topology_desc(
        platform="cuda", topology_name="", target_config=gpu_target_config(t), topology=f"1x{hosts}x{per_host}"
    )
    return tuple(topo.devices)


def lowering(*args):
    """A context in which jax lowers a program over `args` for the GPU their (compile-only) devices
    are: Pallas's Triton lowering asks jax's default device which GPU it writes for (jax 0.11 on;
    0.10.2 asked the program's devices), and off a GPU host that is the CPU, which it refuses
    ("No supported GPU devices found"). Elsewhere (a CPU's or a TPU's arrays) nothing changes."""
    import jax

    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        device = next(iter(sharding.device_set), None) if sharding is not None else None
        if device is not None and device.platform == "gpu":
            return jax.default_device(device)
    return contextlib.nullcontext()
