"""What a run does differently by platform, decided here and nowhere else.

XLA:CPU is a platform of its own for a decode step: it computes bf16 dots in f32 several times
slower than f32 ones, copies every weight a layer scan slices, and gives one device's program
one core. The engine, the engine factory and the grouped GEMM ask this module; config objects
and model code hold no platform choice. `platform` arguments default to this machine's backend;
a program compiled for another (`moejax plan --target`) names its platform.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os

# engine.layer_loop "auto" unrolls runs of at most this many layers on XLA:CPU, where a scan
# step's slice of each weight is a copy read and written once more per layer; unrolled, compile
# time grows with depth, so a deep run keeps its scan.
UNROLLED_LAYERS = 16
# ... and every run on a GPU: XLA:GPU copies a scanned layer's weights out of their stack before
# each GEMM reads them (a `dynamic_slice_fusion` memcpy of the attention, router and shared
# expert's weights, every layer of every step), where a layer's own buffers are read in place.
# A TPU reads a layer's slice in place (its prefetch into on-chip memory): it keeps the scan.
UNROLLS_EVERY_RUN = ("gpu", "cuda")

# Prompt positions per prefill call (engine.prefill_chunk 0). On XLA:CPU a prompt runs fastest in
# as few calls as possible (each expert GEMM gets more rows per expert); the cap bounds the
# attention scores [B, H, chunk, cache] a call holds.
PREFILL_CHUNK = {"cpu": 1024}
PREFILL_CHUNK_OTHER = 512

# The grouped-GEMM backend kernel "auto" stands for, by platform (else the plain XLA loop).
AUTO_KERNEL = {"cpu": "xla", "tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}

# XLA compiler options of decode programs, by platform. A decode step's dots are small (a few
# rows per expert, a batch of rows through the LM head): on XLA:CPU its own dot emitter runs them
# faster than its YNN fusions, which a prefill's large dots gain from (docs/cpu-host.md).
DECODE_COMPILER_OPTIONS = {"cpu": {"xla_cpu_experimental_ynn_fusion_type": ""}}

# XLA compiler options of every program of a run, by run dtype and platform. XLA:GPU's dot merger
# joins small products of one input into one and slices its result: in float32, the router's logits
# and the shared expert's gate|up (a bf16 run's router reads its own float32 copy of the rows). Its
# Triton GEMM fusion of the down product then tiles the gate and the up columns, stride-2 slices of
# that slice, wrongly: a CHECK fails and the process aborts (jaxlib 0.10.2,
# triton_tiling_propagation.cc "subdim_size_accumulator == dim_size"). A float32 run merges none.
_NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}
DTYPE_COMPILER_OPTIONS = {"float32": {"gpu": _NO_DOT_MERGER, "cuda": _NO_DOT_MERGER}}

# The matmul precision of a run's products, by run dtype (else each platform's default). float32
# means float32 products on every platform: XLA:GPU and Triton would multiply float32 as TF32 (an
# H200's float32 logits were 1.1e-3 off transformers', 1.2e-6 at full precision) and the TPU in one
# bf16 pass; XLA:CPU's float32 products are full precision either way.
MATMUL_PRECISION = {"float32": "highest"}

# The paged-attention kernel "auto" stands for, by platform (else the XLA gather).
AUTO_ATTENTION_KERNEL = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}

# How the XLA grouped GEMM (`pallas_kernels/gmm_xla.py`) meets its rows, by platform. XLA:CPU
# loops over the touched groups only, a trip count computed on the device; up to GATHER_ROWS rows
# (a decode step of a few requests) of unquantized experts it gathers each row's expert and runs
# one batched product instead: there a group of its loop costs more than a second read of a group
# two rows share. An accelerator's runtime reads the condition of a loop whose trip count the
# compiler does not know back to the host every iteration (XLA:GPU: a sync per group, per layer),
# so there no loop depends on the picks: up to ACCELERATOR_GATHER_ROWS rows each row's expert is
# loaded (a 4-bit one decoded) and multiplied by the row, as one gather on a GPU (XLA:GPU fuses the
# gather into the product, reading each row's expert once) and a slice per row on a TPU (its
# compiler copies whole stacks into a gather of large slices); more rows go a tile at a time in a
# loop of as many tiles as they can fill (megablox's schedule, `pallas_kernels.tiling.schedule`).
GATHER_ROWS = 16
ACCELERATOR_GATHER_ROWS = 128

# The KV cache's page pool when no size is given (`serving/kv_pages.py`): on XLA:CPU a fixed
# number of positions, serve's 16 default slots at its default longest request of 2,048 (a step
# reads only its requests' pages: an idle page costs memory, not time); on an accelerator this
# share of the memory the devices have free once the weights are in (the rest holds activations
# and programs).
CPU_KV_CACHE_TOKENS = 32768
KV_MEMORY_SHARE = 0.8


# A GPU's decode step runs its small products in fused decode kernels (`moejax/model/projections.py`,
# `sharding/experts.py`): every projection of a few rows there was a weight-sized multiply and a
# reduce, and the MoE's group bookkeeping some twenty small kernels. Up to DECODE_KERNEL_ROWS rows
# (a serving batch's decode rows); a prefill chunk's rows go through XLA's GEMMs and the grouped GEMM.
DECODE_KERNEL_ROWS = 128
# The grouped-GEMM kernels that come with the fused decode kernels (Triton's; the interpreter's, tests).
DECODE_KERNELS = ("pallas_gpu", "interpret_gpu")


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """How a placement runs a decode step's small products: `kernel` "xla", or the fused decode
    kernels' backend ("pallas_gpu"; "interpret_gpu": the same kernels in Pallas's interpreter) for
    passes of at most `rows` rows (a layer's dense products here, its experts by pick in
    `sharding/experts.py`); `precision`: the products' matmul precision (None: the platform's
    default); `device`: (device kind, cores) the kernels' tiles are looked up for
    (`pallas_kernels/tiles.py`); `dense`: whether a layer's dense products run in them too (its
    dense weights whole on the one device the kernel is a program of)."""

    kernel: str = "xla"
    rows: int = 0
    precision: str | None = None
    device: tuple[str, int] = ("", 0)

    dense: bool = False

    def fuses(self, rows: int) -> bool:
        """Whether a pass of `rows` rows multiplies its experts by pick."""
        return self.kernel != "xla" and rows <= self.rows

    def fuses_dense(self, rows: int) -> bool:
        """Whether a pass of `rows` rows runs a layer's dense products in the fused kernels."""
        return self.dense and self.fuses(rows)

    @property
    def interpret(self) -> bool:
        return self.kernel == "interpret_gpu"


XLA = DecodeKernels()


# Device files of the accelerators jax's plugins drive: NVIDIA GPUs, TPUs (and their VFIO form).
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def attached_accelerator() -> bool:
    """Whether this host has a GPU or TPU attached. Without one, the compile-only plugins of the
    `targets` extra (jax's CUDA plugin, libtpu) would each try to start a device at jax's first
    use and print their failures; the CLI then runs jax on the CPU alone (`startup.jax_platforms`)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def backend(platform: str | None = None) -> str:
    """`platform`, or this machine's jax backend ("cpu", "gpu", "tpu")."""
    if platform:
        return platform
    import jax  # here, so that reading a config does not load jax

    return jax.default_backend()


def host_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one: not on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_dtype(dtype: str, platform: str | None = None) -> str:
    """engine.dtype with "auto" resolved: float32 on XLA:CPU (its bf16 dots are slower), else bfloat16."""
    if dtype != "auto":
        return dtype
    return "float32" if backend(platform) == "cpu" else "bfloat16"


def unrolls(layer_loop: str, layers: int, platform: str | None = None) -> bool:
    """Whether a run of `layers` identical layers executes unrolled over per-layer arrays (else as
    a scan over their stack), for engine.layer_loop ("auto": on XLA:CPU short runs, on a GPU
    every run, on a TPU none)."""
    if layer_loop != "auto":
        return layer_loop == "unroll"
    where = backend(platform)
    return where in UNROLLS_EVERY_RUN or (where == "cpu" and layers <= UNROLLED_LAYERS)


def forms_on_device(platform: str | None = None) -> bool:
    """Whether random weights are drawn, and 4-bit experts quantized, on the run's first device:
    on an accelerator (seconds; the host's CPU device took 176 s for the 48-layer Qwen3-30B-A3B
    shape, then a copy to the device), not on XLA:CPU, where the host's device works a few experts
    at a time to bound its temporaries (`checkpoints/placing.py`)."""
    return backend(platform) != "cpu"


def buffers_apart(platform: str | None = None) -> bool:
    """Whether an unrolled run holds its slices as buffers of their own: a decode block's
    contiguous cache a buffer set per layer (`kv_cache.per_layer`), and, for a kernel that
    multiplies a group where it lies through a `lax.switch`, each expert of a layer
    (`pallas_kernels/layered.py`). On XLA:CPU only, where a slice read out of a stack is a copy.
    On a GPU the split cache is a second whole cache (a block over Qwen3-30B-A3B's 206 GB of
    cache took 206 GB more), and a conditional would read its branch index back to the host."""
    return backend(platform) == "cpu"


def prefill_chunk(chunk: int, platform: str | None = None) -> int:
    """engine.prefill_chunk with 0 resolved to the platform's default."""
    return chunk or PREFILL_CHUNK.get(backend(platform), PREFILL_CHUNK_OTHER)


def kernel(name: str, platform: str | None = None) -> str:
    """The grouped-GEMM backend kernel `name` stands for on `platform` ("auto": by platform)."""
    return AUTO_KERNEL.get(backend(platform), "xla") if name == "auto" else name


def gemm_rows(rows: int, quantized: bool, platform: str | None = None) -> str:
    """How the XLA grouped GEMM multiplies `rows` rows by a stack of experts (`quantized`: 4-bit)
    on `platform`: "groups" (a loop over the touched groups), "gather" (each row's expert gathered,
    one batched product), "rows" (each row's expert sliced and multiplied apart) or "tiles" (a loop
    of a static number of row tiles)."""
    where = backend(platform)
    if where == "cpu":
        return "gather" if rows <= GATHER_ROWS and not quantized else "groups"
    if rows > ACCELERATOR_GATHER_ROWS:
        return "tiles"
    return "rows" if where == "tpu" else "gather"


def compiler_options(dtype: str, decode: bool = False, platform: str | None = None) -> dict | None:
    """XLA compiler options of a jitted engine program of a run in `dtype` (a dtype or its name) on
    `platform`; `decode`: a decode program (None: XLA's defaults)."""
    name = backend(platform)
    options = {
        **(DECODE_COMPILER_OPTIONS.get(name, {}) if decode else {}),
        **DTYPE_COMPILER_OPTIONS.get(str(dtype), {}).get(name, {}),
    }
    return options or None


def matmul_precision(dtype) -> str | None:
    """jax's matmul precision for the products of a run in `dtype` (a dtype or its name): "highest"
    for float32, None (the platform's default) otherwise."""
    return MATMUL_PRECISION.get(str(dtype))


def at_matmul_precision(fn, dtype):
    """`fn` traced at the matmul precision of a run in `dtype`: every product an engine program
    (or a kernel it calls) traces without a precision of its own takes it."""
    precision = matmul_precision(dtype)
    if precision is None:
        return fn
    import jax

    @functools.wraps(fn)  # the signature a jit reads static arguments from
    def traced(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    # the program's name (jit_decode_step, ...), which `moejax trace` matches
    traced.__name__ = traced.__qualname__ = getattr(fn, "func", fn).__name__
    return traced


def kv_cache_bytes(devices: list) -> int:
    """The page pool's default bytes over `devices`: 0 on XLA:CPU (CPU_KV_CACHE_TOKENS instead),
    else KV_MEMORY_SHARE of the least free device's memory times their count."""
    if devices[0].platform == "cpu":
        return 0
    import jax

    # Over several processes each reads its own devices (`pool_pages` takes the smallest pool).
    stats = [d.memory_stats() or {} for d in devices if d.process_index == jax.process_index()]
    free = min(s.get("bytes_limit", 0) - s.get("bytes_in_use", 0) for s in stats)
    return int(KV_MEMORY_SHARE * max(0, free) * len(devices))


def attention_kernel(name: str, platform: str | None = None) -> str:
    """The paged-attention kernel `name` stands for on `platform` ("auto": by platform)."""
    return AUTO_ATTENTION_KERNEL.get(backend(platform), "xla") if name == "auto" else name


def ragged_all_to_all(platform: str | None = None) -> bool:
    """Whether `jax.lax.ragged_all_to_all` runs on `platform` (XLA:CPU lacks it: an exchange
    sends its whole blocks through a dense all-to-all there)."""
    return backend(platform) != "cpu"


def slices_over_cores(platform: str | None = None) -> bool:
    """Whether layout.devices "auto" means one virtual device per core with every weight sliced
    over them (XLA:CPU runs one device's program on one core), rather than one device."""
    return backend(platform) == "cpu"


def concurrent_devices(platform: str | None = None) -> int:
    """How many devices' programs run at once (XLA:CPU's virtual devices share the host's cores)."""
    return host_cores() if backend(platform) == "cpu" else 1 << 20


def decode_kernels(gemm_kernel: str, dtype, device, dense: bool) -> DecodeKernels:
    """The decode kernels of a run whose grouped GEMM is `gemm_kernel`, in `dtype`, on `device` (its
    first device: kind and cores pick the tiles); `dense`: whether its layers' dense weights lie
    whole on the one device (the fused kernels are one device's programs)."""
    if gemm_kernel not in DECODE_KERNELS:
        return XLA
    cores = getattr(device, "core_count", 0) or 0
    return DecodeKernels(gemm_kernel, DECODE_KERNEL_ROWS, matmul_precision(dtype), (device.device_kind, cores), dense)
