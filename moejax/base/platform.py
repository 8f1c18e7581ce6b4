"""What a run does differently by platform, decided here and nowhere else.

XLA:CPU is a platform of its own for a decode step: it computes bf16 dots in f32 several times
slower than f32 ones, copies every weight a layer scan slices, and gives one device's program
one core. A run's decisions are one record (`Platform`), resolved once (`resolve`) for this
machine's backend or for a compile target's platform (`moejax plan --target`); the placement
keeps it, the engine and the engine factory ask it, and the kernels receive its decisions as
arguments. Config objects and model code hold no platform choice.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import sys
from collections.abc import Callable

# One name per platform: jax calls a GPU "gpu" (its backend) or "cuda" (export, topologies).
PLATFORMS = ("cpu", "gpu", "tpu")
JAX_NAMES = {"cuda": "gpu"}

# engine.layer_loop "auto" unrolls runs of at most this many layers, by platform (else none). On
# XLA:CPU a scan step's slice of each weight is a copy read and written once more per layer;
# unrolled, compile time grows with depth, so a deep run keeps its scan. On a GPU every run:
# XLA:GPU copies a scanned layer's weights out of their stack before each GEMM reads them (a
# `dynamic_slice_fusion` memcpy of the attention, router and shared expert's weights, every layer
# of every step), where a layer's own buffers are read in place. A TPU reads a layer's slice in
# place (its prefetch into on-chip memory): it keeps the scan.
UNROLLED_LAYERS = {"cpu": 16, "gpu": sys.maxsize}

# Prompt positions per prefill call (engine.prefill_chunk 0). On XLA:CPU a prompt runs fastest in
# as few calls as possible (each expert GEMM gets more rows per expert); the cap bounds the
# attention scores [B, H, chunk, cache] a call holds.
PREFILL_CHUNK = {"cpu": 1024}
PREFILL_CHUNK_OTHER = 512

# The grouped-GEMM kernels "auto" tries, by platform, in order: the first whose catalog record finds
# it runnable (`pallas_kernels.catalog.Kernel.why_not`: its backend in this jax, the run's dtype,
# the experts' format and widths, the GPU's architecture) is the run's, else the plain XLA loop. A
# GPU's by its compute capability's major version (AUTO_GPU_KERNELS; other GPUs: "gpu"): Mosaic
# GPU's kernels first, the Triton one only where they cannot run (float32 rows: wgmma multiplies
# them as TF32; an Ampere GPU) and only while this jax still has Pallas's Triton backend (jax 0.11
# deprecated it). On Blackwell the bf16-rows x 4-bit-weights kernel: the 4-bit x 4-bit one
# (`blackwell`) quantizes the rows too, a change of the run's numbers a user asks for by name.
AUTO_KERNELS = {"cpu": (), "tpu": ("pallas_tpu",), "gpu": ("triton",)}
AUTO_GPU_KERNELS = {9: ("mosaic_gpu", "triton"), 10: ("blackwell_bf16", "triton")}

# The paged-attention kernel "auto" stands for, by platform (else the XLA gather).
AUTO_ATTENTION_KERNEL = {"tpu": "pallas_tpu", "gpu": "mosaic_gpu"}

# XLA compiler options of decode programs, by platform. A decode step's dots are small (a few
# rows per expert, a batch of rows through the LM head): on XLA:CPU its own dot emitter runs them
# faster than its YNN fusions, which a prefill's large dots gain from (docs/cpu-host.md).
#
# On a GPU a decode step is some 14 kernels a layer of a few microseconds each: launched one by
# one, the launches alone cost about what the step's bytes do. XLA:GPU records runs of them as CUDA
# graphs (command buffers) and launches each graph once: every fusion, library GEMM and custom call
# (Triton's and Mosaic GPU's kernels), and the loop of a decode block and its conditionals (as
# graph nodes, with CUDA 12.3's conditional nodes) so that a block of steps is one graph, however
# short a run of kernels is (XLA's default leaves runs under 5 ops and every loop outside graphs).
GPU_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
DECODE_COMPILER_OPTIONS = {
    "cpu": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "gpu": {"xla_gpu_enable_command_buffer": GPU_COMMAND_BUFFERS, "xla_gpu_graph_min_graph_size": 1},
}

# XLA compiler options of every program of a run, by run dtype and platform. XLA:GPU's dot merger
# joins small products of one input into one and slices its result: in float32, the router's logits
# and the shared expert's gate|up (a bf16 run's router reads its own float32 copy of the rows). Its
# Triton GEMM fusion of the down product then tiles the gate and the up columns, stride-2 slices of
# that slice, wrongly: a CHECK fails and the process aborts (jaxlib 0.10.2,
# triton_tiling_propagation.cc "subdim_size_accumulator == dim_size"). A float32 run merges none.
DTYPE_COMPILER_OPTIONS = {"float32": {"gpu": {"xla_gpu_dot_merger_threshold_mb": 0}}}

# The matmul precision of a run's products, by run dtype (else each platform's default). float32
# means float32 products on every platform: XLA:GPU and Triton would multiply float32 as TF32 (an
# H200's float32 logits were 1.1e-3 off transformers', 1.2e-6 at full precision) and the TPU in one
# bf16 pass; XLA:CPU's float32 products are full precision either way.
MATMUL_PRECISION = {"float32": "highest"}

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
KV_CACHE_TOKENS = {"cpu": 32768}
KV_MEMORY_SHARE = 0.8

# Whose buffers and temporaries a compiled program's figures are (`moejax plan`).
COMPILERS = {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "tpu": "the TPU compiler"}

# A GPU's decode step runs its small products in fused decode kernels (`moejax/model/projections.py`,
# `sharding/experts.py`): every projection of a few rows there was a weight-sized multiply and a
# reduce, and the MoE's group bookkeeping some twenty small kernels. The dense products up to
# DECODE_KERNEL_ROWS rows a device (a serving batch's decode rows); the experts by pick up to
# DECODE_PICK_ROWS rows, the rows every device's experts see where a placement gathers the batch
# (8 devices at 256 requests: 256 rows of 8 picks, 16 a Qwen3 expert and 8 a GLM-5 one, each
# expert's picks one chunk of the pick GEMM, where the sorted grouped GEMM was two dozen more
# kernels a layer). A prefill chunk's rows go through XLA's GEMMs and the grouped GEMM.
DECODE_KERNEL_ROWS = 128
DECODE_PICK_ROWS = 256
# Which grouped GEMMs' runs take them is their catalog records' (`pallas_kernels.catalog`: `decode`):
# a Hopper's `mosaic_gpu` run takes Mosaic GPU's set only (Triton stays where Mosaic GPU cannot go).


# A layer's dense products by the weights they multiply (`moejax/model/projections.py`): attention's
# q|k|v and output projection, the router, a dense layer's MLP and the shared experts.
DENSE_GROUPS = ("attention", "router", "mlp", "shared_mlp")


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """How a placement runs a decode step's small products: `kernel` "xla", or the fused decode
    kernels' backend ("triton", "pallas_tpu"; "interpret_triton", "interpret_tpu": the same kernels
    in Pallas's interpreter): a layer's dense products here, for passes of at most `rows` rows a
    device, and its experts by pick (`sharding/experts.py`), for passes of at most `pick_rows`;
    `precision`: the products' matmul precision (None: the platform's default); `device`: (device
    kind, cores) the kernels' tiles are looked up for (`pallas_kernels/tiles.py`); `dense`: the
    DENSE_GROUPS whose products run in them too (the set has kernels for them, and their weights
    lie whole on each device: a kernel multiplies one device's rows by whole weights);
    `per_device`: on a mesh, how a kernel runs on each device's rows (`Placement.per_device`), None
    on one device."""

    kernel: str = "xla"
    rows: int = 0
    pick_rows: int = 0
    precision: str | None = None
    device: tuple[str, int] = ("", 0)

    dense: frozenset = frozenset()
    linear: str | None = None  # the dense products' kernel (a DECODE record's name: `pallas_kernels.fused_linear`)
    # It reads a layer's weights in their run's stacks and in their model's shapes (a TPU's: a scan's
    # slice of a stack, or a reshape of a tiled [D, H, Dh], is a copy); else each layer's, reshaped.
    linear_reads_stacks: bool = False
    topk: str | None = None  # the top-k after the router's product (a DECODE record's name; None: XLA's ops)
    whole_ffn: bool = False  # the experts as one call (`pallas_kernels.expert_ffn`), else two pick GEMMs
    router: str | None = None  # the router as one call (a DECODE record's name: `pallas_kernels.route`)
    per_device: Callable | None = None
    row_shards: int = 1

    def fuses(self, rows: int) -> bool:
        """Whether a pass of `rows` rows multiplies its experts by pick."""
        return self.kernel != "xla" and rows <= self.pick_rows

    def routes(self, rows: int) -> bool:
        """Whether a pass of `rows` rows runs the MoE's norm and router as one kernel."""
        return self.router is not None and self._fuses_local(rows)

    def fuses_dense(self, rows: int, group: str) -> bool:
        """Whether a pass of `rows` rows runs the products of `group` (one of DENSE_GROUPS) in the
        fused kernels, each device's share of them."""
        return group in self.dense and self._fuses_local(rows)

    def _fuses_local(self, rows: int) -> bool:
        return self.kernel != "xla" and self.local(rows) <= self.rows

    def local(self, rows: int) -> int:
        """A device's share of a pass of `rows` rows (every row where they do not divide)."""
        return rows // self.row_shards if rows % self.row_shards == 0 else rows

    def run(self, kernel: Callable, rows: tuple, whole: tuple):
        """kernel(rows, whole): rows [M, ...] (or None) and the weights `whole` -> outputs [M, ...],
        on each device's rows where the run spans a mesh (a Pallas kernel is one device's program)."""
        return kernel(rows, whole) if self.per_device is None else self.per_device(kernel, rows, whole)


XLA = DecodeKernels()


# Device files of the accelerators jax's plugins drive: NVIDIA GPUs, TPUs (and their VFIO form).
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def tile_device(device) -> tuple[str, int]:
    """(device kind, SMs or cores) of `device` (this machine's, or a compile target's: its record's
    cores, `moejax/base/targets.py`), what the kernels' tiles are looked up for (`pallas_kernels/tiles.py`);
    0 cores where jax describes none."""
    return device.device_kind, getattr(device, "core_count", 0) or 0


def canonical(name: str) -> str:
    """jax's name of a platform ("cpu", "gpu", "cuda", "tpu") as one of PLATFORMS ("cuda": "gpu")."""
    name = JAX_NAMES.get(name, name)
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; moejax runs on {', '.join(PLATFORMS)}")
    return name


@dataclasses.dataclass(frozen=True)
class Platform:
    """The decisions of a run on one platform (see the tables above for why each is what it is)."""

    name: str  # one of PLATFORMS
    auto_kernels: tuple[str, ...]  # the grouped GEMMs "auto" tries, in order (on a GPU: `gemm_candidates`)
    auto_attention_kernel: str  # the paged attention "auto" stands for
    # layer_loop "auto" unrolls runs of at most this many layers
    unrolled_layers: int
    # Whether an unrolled run holds its slices as buffers of their own: a decode block's contiguous
    # cache a buffer set per layer (`kv_cache.per_layer`), and, for a kernel that multiplies a group
    # where it lies through a `lax.switch`, each expert of a layer (`pallas_kernels/layered.py`). On
    # XLA:CPU only, where a slice read out of a stack is a copy. On a GPU the split cache is a second
    # whole cache (a block over Qwen3-30B-A3B's 206 GB of cache took 206 GB more), and a conditional
    # would read its branch index back to the host.
    buffers_apart: bool
    # Whether `jax.lax.ragged_all_to_all` runs (XLA:CPU lacks it: an exchange sends its whole blocks
    # through a dense all-to-all there).
    ragged_all_to_all: bool
    # Whether random weights are drawn, and 4-bit experts quantized, on the run's first device: on an
    # accelerator (seconds; the host's CPU device took 176 s for the 48-layer Qwen3-30B-A3B shape,
    # then a copy to the device), not on XLA:CPU, where the host's device works a few experts at a
    # time to bound its temporaries (`checkpoints/placing.py`).
    forms_on_device: bool
    # Whether layout.devices "auto" means one virtual device per core with every weight sliced over
    # them (XLA:CPU runs one device's program on one core), rather than one device.
    slices_over_cores: bool
    # Whether `moejax plan` compiles every run of layers as a scan over its stacked weights: on
    # XLA:CPU, whose unrolled short runs are a speed choice of its own, not the plan's.
    plan_scans: bool
    prefill_chunk: int  # engine.prefill_chunk 0
    kv_cache_tokens: int | None  # the page pool's default positions (None: KV_MEMORY_SHARE of free memory)
    compiler: str  # whose programs they are
    # Whether its compiler logs from C++, as it starts on a host without the device, that it finds
    # none (libtpu: its accelerator type, its hosts), before any log setting applies.
    starts_loudly: bool

    def gemm_candidates(self, name: str, device=None) -> tuple[str, ...]:
        """The grouped GEMMs kernel `name` may stand for on `device` (a GPU's compute capability picks
        its row of AUTO_GPU_KERNELS), in order: the first whose catalog record finds it runnable is the
        run's (`sharding.placement.gemm_kernel`), else "xla" (the list's last). A name other than
        "auto" stands for itself."""
        if name != "auto":
            return (name,)
        from pallas_kernels.probes import gpu_major  # loaded with jax: a config's reader loads neither

        major = gpu_major(device) if self.name == "gpu" else None
        return (*AUTO_GPU_KERNELS.get(major, self.auto_kernels), "xla")

    def attention_kernel(self, name: str) -> str:
        """The paged-attention kernel `name` stands for ("auto": the platform's)."""
        return self.auto_attention_kernel if name == "auto" else name

    def run_dtype(self, dtype: str) -> str:
        """engine.dtype with "auto" resolved: float32 on XLA:CPU (its bf16 dots are slower), else bfloat16."""
        if dtype != "auto":
            return dtype
        return "float32" if self.name == "cpu" else "bfloat16"

    def unrolls(self, layer_loop: str, layers: int) -> bool:
        """Whether a run of `layers` identical layers executes unrolled over per-layer arrays (else as
        a scan over their stack), for engine.layer_loop ("auto": on XLA:CPU short runs, on a GPU
        every run, on a TPU none)."""
        if layer_loop != "auto":
            return layer_loop == "unroll"
        return layers <= self.unrolled_layers

    def gemm_rows(self, rows: int, quantized: bool) -> str:
        """How the XLA grouped GEMM multiplies `rows` rows by a stack of experts (`quantized`: 4-bit):
        "groups" (a loop over the touched groups), "gather" (each row's expert gathered, one batched
        product), "rows" (each row's expert sliced and multiplied apart) or "tiles" (a loop of a static
        number of row tiles)."""
        if self.name == "cpu":
            return "gather" if rows <= GATHER_ROWS and not quantized else "groups"
        if rows > ACCELERATOR_GATHER_ROWS:
            return "tiles"
        return "rows" if self.name == "tpu" else "gather"

    def compiler_options(self, dtype, decode: bool = False) -> dict | None:
        """XLA compiler options of a jitted engine program of a run in `dtype` (a dtype or its name);
        `decode`: a decode program (None: XLA's defaults)."""
        options = {
            **(DECODE_COMPILER_OPTIONS.get(self.name, {}) if decode else {}),
            **DTYPE_COMPILER_OPTIONS.get(str(dtype), {}).get(self.name, {}),
        }
        return options or None

    @staticmethod
    def matmul_precision(dtype) -> str | None:
        """jax's matmul precision for the products of a run in `dtype` (a dtype or its name): "highest"
        for float32, None (the platform's default) otherwise."""
        return MATMUL_PRECISION.get(str(dtype))

    def at_matmul_precision(self, fn, dtype):
        """`fn` traced at the matmul precision of a run in `dtype`: every product an engine program
        (or a kernel it calls) traces without a precision of its own takes it."""
        precision = self.matmul_precision(dtype)
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

    def decode_kernels(self, kernel: str | None, dtype, device, **how) -> DecodeKernels:
        """The decode kernels `kernel` (a decode kernel's name, None: XLA's ops) of a run in `dtype` on
        `device` (its first device: kind and cores pick the tiles); how: DecodeKernels' fields from
        `dense` on (which products they run, and how on a mesh)."""
        if kernel is None:
            return XLA
        return DecodeKernels(
            kernel, DECODE_KERNEL_ROWS, DECODE_PICK_ROWS, self.matmul_precision(dtype), tile_device(device), **how
        )

    def kv_cache_bytes(self, devices: list) -> int:
        """The page pool's default bytes over `devices` where the platform sizes it by memory
        (`kv_cache_tokens` None): KV_MEMORY_SHARE of the least free device's memory times their count."""
        import jax

        # Over several processes each reads its own devices (`pool_pages` takes the smallest pool).
        stats = [d.memory_stats() or {} for d in devices if d.process_index == jax.process_index()]
        free = min(s.get("bytes_limit", 0) - s.get("bytes_in_use", 0) for s in stats)
        return int(KV_MEMORY_SHARE * max(0, free) * len(devices))

    def concurrent_devices(self) -> int:
        """How many devices' programs run at once (XLA:CPU's virtual devices share the host's cores)."""
        return host_cores() if self.name == "cpu" else 1 << 20


@functools.cache
def _record(name: str) -> Platform:
    return Platform(
        name=name,
        auto_kernels=AUTO_KERNELS[name],
        auto_attention_kernel=AUTO_ATTENTION_KERNEL.get(name, "xla"),
        unrolled_layers=UNROLLED_LAYERS.get(name, 0),
        buffers_apart=name == "cpu",
        ragged_all_to_all=name != "cpu",
        forms_on_device=name != "cpu",
        slices_over_cores=name == "cpu",
        plan_scans=name == "cpu",
        prefill_chunk=PREFILL_CHUNK.get(name, PREFILL_CHUNK_OTHER),
        kv_cache_tokens=KV_CACHE_TOKENS.get(name),
        compiler=COMPILERS[name],
        starts_loudly=name == "tpu",
    )


def resolve(name: str | None = None) -> Platform:
    """The decisions of a run on platform `name` (jax's name: a compile target's "cuda" or "tpu"),
    default this machine's jax backend."""
    if not name:
        import jax  # here, so that reading a config does not load jax

        name = jax.default_backend()
    return _record(canonical(name))


def run_dtype(dtype: str, platform: str | None = None) -> str:
    """engine.dtype with "auto" resolved for `platform` (default: this machine's), for the readers of
    a config that build no placement (checkpoints, `compare`, the cost tables)."""
    return resolve(platform).run_dtype(dtype)


def prefill_chunk(chunk: int, platform: str | None = None) -> int:
    """engine.prefill_chunk with 0 resolved to `platform`'s default (this machine's by default)."""
    return chunk or resolve(platform).prefill_chunk


def attached_accelerator() -> bool:
    """Whether this host has a GPU or TPU attached. Without one, the compile-only plugins of the
    `targets` extra (jax's CUDA plugin, libtpu) would each try to start a device at jax's first
    use and print their failures; the CLI then runs jax on the CPU alone (`host_alone`)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def host_alone() -> bool:
    """Whether jax runs on the host's CPU alone: JAX_PLATFORMS as the user set it, else "cpu" (set
    here, before jax's import) on a host with no accelerator attached."""
    if "JAX_PLATFORMS" not in os.environ and not attached_accelerator():
        os.environ["JAX_PLATFORMS"] = "cpu"
    return os.environ.get("JAX_PLATFORMS") == "cpu"


def host_device():
    """The host's CPU device, where weights are formed off an accelerator (`Platform.forms_on_device`)."""
    import jax

    return jax.local_devices(backend="cpu")[0]


def host_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one: not on macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
