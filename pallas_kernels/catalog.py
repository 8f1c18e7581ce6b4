"""Every kernel moejax runs, one record each: the only list of them.

A record says where its kernel runs (platform, GPU architectures, the Pallas backend and the jax
names it is built on), what it multiplies (row dtypes, expert formats, shapes), what it reads, and
answers the one question of whether it can run here (`Kernel.why_not`). The registry
(`registry.py`), the layer views (`layered.py`), the paged attention (`paged_attention.py`) and the
placement's choice (`sharding/placement.py`) read their tables from here; the CLI's closed words
are `moejax.vocab`'s, which tests/test_vocab.py checks are these names. Which kernel "auto" stands
for is `moejax.base.platform`'s order of names.

A name means one backend wherever it is used: "mosaic_gpu" is Mosaic GPU as a grouped GEMM and as
a paged attention, "pallas_tpu" Mosaic TPU, "triton" Pallas's Triton backend.

A kernel's module is imported on first use (`load`), so a CPU run never loads Mosaic GPU, Triton
or Mosaic TPU (~0.3 s of every command's start-up), and a jax that lacks a kernel's names is told
so (`api`) before an import that would build its layouts.
"""

from __future__ import annotations

import dataclasses
import importlib

from moejax.vocab import DTYPES, EXPERT_FORMATS, QUANTIZED_FORMATS
from pallas_kernels import probes, tiles

# The roles: grouped GEMMs (--kernel), paged attentions (--attention-kernel), a decode step's fused kernels.
GEMM, ATTENTION, DECODE = "grouped_gemm", "paged_attention", "decode"
PLATFORM_NAMES = {"tpu": "a TPU", "gpu": "an NVIDIA GPU"}
MOSAIC_GPU, PALLAS = "jax.experimental.pallas.mosaic_gpu", "jax.experimental.pallas"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel: `function` of module `pallas_kernels.<module>` (default: the module's name)."""

    name: str  # its word (vocab.KERNELS, vocab.ATTENTION_KERNELS; the decode kernels': `DecodeKernels.kernel`)
    role: str  # GEMM, ATTENTION or DECODE
    module: str
    backend: str  # what compiles it: "xla", "triton", "mosaic_gpu" or "mosaic_tpu"
    function: str = ""
    platform: str | None = None  # "cpu", "gpu", "tpu"; None: any (XLA's, or Pallas' interpreter)
    architectures: tuple[int, ...] = ()  # compute-capability majors of the GPUs it is written for; (): any
    needs: str = ""  # the device it needs, as a refusal names it (default: its platform's)
    dtypes: tuple[str, ...] = DTYPES  # the rows' dtypes it multiplies
    formats: tuple[str, ...] = EXPERT_FORMATS  # the experts' formats it multiplies
    multiplies: str = ""  # what it multiplies, as a refusal of another dtype or format says
    # Its module's `name(k, n, gated, tiles) -> str | None` refusing a device's [K, N] experts (`gated`:
    # N interleaves gate and up) in the tiles the table gives them, checked for experts in one of
    # `shape_formats`.
    shape_check: str | None = None
    shape_formats: tuple[str, ...] = EXPERT_FORMATS
    # What it reads: "stack" (a layer's groups in place in its stack, `layered.LayerOf`), "groups"
    # (a layer's experts a buffer each, `layered.Groups`), "rows" (its rows through lhs_rows),
    # "metadata" (group sizes of rows sorted by group), "picks" (each row's expert ids, unsorted);
    # a paged attention: "kv" (one pool of keys and values interleaved by head, else pools k and v),
    # "prefill" (a prefill chunk's many positions per request, else one: decode steps), "windows"
    # (sliding windows and attention sinks), "latent" (MLA's pools latent and k_rope, DSA's selection).
    reads: frozenset = frozenset()
    scales_columns: bool = False  # applies a 4-bit stack's column-wise tensor scales itself
    prepares: str | None = None  # its module's function taking 4-bit experts to its own layout (once, at load)
    # The decode sets (DECODE records' names) a run of this grouped GEMM takes, the first that can run.
    decode: tuple[str, ...] = ()
    # A decode set's kernels, each a DECODE record's name: `dense`, the one its layers' dense products
    # run in (`fused_linear`: `linear.py`, `linear_mgpu.py`; None: XLA's ops); `topk`, the router's
    # top-k after such a product (`routing.py`; None: XLA's ops); `router`, one kernel for the norm,
    # logits and top-k. `whole_ffn`: the experts as one call (gate|up, act, down and the picks' sum),
    # else as two pick GEMMs.
    dense: str | None = None
    topk: str | None = None
    router: str | None = None
    whole_ffn: bool = False
    # A dense kernel: takes MLA's projections' epilogues (heads of a width per segment, a rope from a
    # head's column rope_at, interleaved pairs); else MLA's attention products are XLA's ops.
    latent_heads: bool = False
    interpreted: bool = False  # runs in Pallas' interpreter (any platform: tests)
    # Takes operands typed as varying over a shard_map's mesh axes (check_vma). Not the warp-specialized
    # Mosaic GPU kernels: `plgpu.warp_map` is an mpmd_map, which from jax 0.11 refuses such Refs.
    varying_operands: bool = True
    tiles: str | None = None  # its key in the tile table (`tiles.py`)
    takes: tuple[str, ...] = ()  # the platform's decisions it takes (`registry.grouped_gemm`'s arguments)
    api: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (jax module, names) it is built on

    def why_not(self, platform: str, device=None, dtype="bfloat16", expert_format="unquantized", shapes=()):
        """The one-line reason this kernel cannot run on `platform` ("cpu", "gpu", "tpu"), on `device`
        (a compile target's, or this machine's; one without a compute capability: not checked), for
        rows of `dtype` times experts of `expert_format` whose per-device (K, N, gated) are `shapes`;
        None where it can."""
        return (
            self._platform_refusal(platform)
            or self._backend_refusal()
            or self._operand_refusal(str(dtype), expert_format)
            or self._architecture_refusal(device)
            or self._shape_refusal(shapes, expert_format)
        )

    def load(self):
        """The kernel's function (its module imported now)."""
        return getattr(self.kernel_module(), self.function or self.module)

    def kernel_module(self):
        return importlib.import_module(f"pallas_kernels.{self.module}")

    def _platform_refusal(self, platform: str) -> str | None:
        if self.platform in (None, platform):
            return None
        twin = next((k.name for k in interpreted_twins(self)), None)
        flag = {GEMM: "kernel", ATTENTION: "attention kernel", DECODE: "decode kernels"}[self.role]
        instead = f" ({flag} {twin} runs it interpreted)" if twin else ""
        return f"needs {self.device_needed}; this machine's backend is {platform}{instead}"

    def _backend_refusal(self) -> str | None:
        if self.backend == "triton" and not probes.has_triton():
            instead = ", ".join(triton_free_gpu_kernels())
            return f"this jax ({probes.jax_version()}) has no Pallas Triton backend; {instead} run on GPUs"
        missing = [name for module, names in self.api for name in probes.missing(module, names)]
        return f"this jax ({probes.jax_version()}) lacks {', '.join(missing)}" if missing else None

    def _operand_refusal(self, dtype: str, expert_format: str) -> str | None:
        if dtype in self.dtypes and expert_format in self.formats:
            return None
        return f"multiplies {self.multiplies}; got {dtype} rows and {expert_format} experts"

    def _architecture_refusal(self, device) -> str | None:
        major = probes.gpu_major(device) if device is not None else None
        if not self.architectures or major is None or major in self.architectures:
            return None
        return f"needs {self.device_needed}; this one is {probes.capability(device)}"

    def _shape_refusal(self, shapes, expert_format: str) -> str | None:
        if self.shape_check is None or expert_format not in self.shape_formats:
            return None
        module = self.kernel_module()
        check = getattr(module, self.shape_check)
        reason = None
        for k, n, gated in shapes:
            chosen = module.Tiles(**tiles.lookup(self.tiles, k=k, n=n, gated=gated))  # the table's for them
            reason = reason or check(k, n, gated, chosen)
        instead = (
            "these experts multiply through XLA (--kernel xla or auto)" if self.role == GEMM else "XLA's ops run it"
        )
        return reason and f"{reason}; {instead}"

    @property
    def device_needed(self) -> str:
        return self.needs or PLATFORM_NAMES[self.platform]


HOPPER = "an NVIDIA Hopper (sm_90) GPU"
BLACKWELL = "an NVIDIA Blackwell (sm_100) GPU"
FOUR_BIT = f"expert format {' or '.join(QUANTIZED_FORMATS)}"
# The Mosaic GPU names each kernel builds on (jax 0.10.2 to 0.12 have them all); the Blackwell
# kernels build tcgen05 layouts at import, so these are asked before their modules are imported.
HOPPER_GEMM_API = ("kernel", "emit_pipeline", "BlockSpec", "wgmma", "wgmma_wait", "ACC", "SMEM", "Layout")
HOPPER_GEMM_API += ("layout_cast", "load", "TilingTransform", "SwizzleTransform", "find_swizzle", "commit_smem")
HOPPER_GEMM_API += ("copy_smem_to_gmem", "wait_smem_to_gmem")
BLACKWELL_API = ("tcgen05_mma", "tcgen05_commit_arrive", "TMEM", "TMEMLayout", "commit_tmem", "warp_map")
BLACKWELL_API += ("async_load_tmem", "async_store_tmem", "wait_load_tmem", "async_copy_scales_to_tmem")
ATTENTION_MOSAIC_GPU_API = ("kernel", "SMEM", "TilingTransform", "SwizzleTransform", "Barrier", "SemaphoreType")
ATTENTION_MOSAIC_GPU_API += ("Layout", "layout_cast", "broadcasted_iota", "copy_gmem_to_smem", "copy_smem_to_gmem")
ATTENTION_MOSAIC_GPU_API += ("wait_smem_to_gmem", "commit_smem", "barrier_wait")
ATTENTION_API = (
    (MOSAIC_GPU, ATTENTION_MOSAIC_GPU_API),
    (PALLAS, ("get_global", "semaphore_signal", "semaphore_wait", "when", "ds", "cdiv")),
)
PICKS_MOSAIC_GPU_API = (
    *HOPPER_GEMM_API,
    "broadcasted_iota",
)  # the pick GEMM's ids as a vector of the wgmma rows' layout
GROUPED = frozenset({"stack", "metadata"})  # a grouped GEMM's reads: rows sorted by group, a layer in its stack

_GEMMS = (
    Kernel(
        "xla",
        GEMM,
        "gmm_xla",
        "xla",
        reads=GROUPED | {"groups", "rows"},
        scales_columns=True,
        takes=("gemm_rows", "precision"),
    ),
    Kernel(
        "pallas_tpu",
        GEMM,
        "gmm_pallas_tpu",
        "mosaic_tpu",
        platform="tpu",
        shape_check="shape_refusal",
        shape_formats=QUANTIZED_FORMATS,  # 4-bit K-halves are tiled in whole 128-lane blocks
        reads=GROUPED,
        decode=("pallas_tpu",),
        takes=("precision",),
        tiles="pallas_tpu",
    ),
    Kernel(
        "triton",
        GEMM,
        "gmm_pallas_gpu",
        "triton",
        platform="gpu",
        reads=GROUPED,
        decode=("triton",),
        takes=("precision",),
        tiles="triton",
    ),
    Kernel(
        "mosaic_gpu",
        GEMM,
        "gmm_mosaic_gpu",
        "mosaic_gpu",
        platform="gpu",
        architectures=(9,),
        needs=HOPPER,
        dtypes=("bfloat16",),
        multiplies="bfloat16 rows only: Hopper's wgmma multiplies float32 as TF32 (10 mantissa bits, ~1e-3 off); "
        "triton or xla multiply float32 at full precision",
        reads=GROUPED,
        # Mosaic GPU's decode set only: leaner than Triton's (an H200's Qwen3-30B-A3B layer 14 launches
        # at batch 1 to 15); where it refuses the widths, XLA's ops (Triton only where Mosaic cannot go).
        decode=("mosaic_gpu",),
        api=((MOSAIC_GPU, HOPPER_GEMM_API),),
        tiles="mosaic_gpu",
    ),
    Kernel(
        "blackwell",
        GEMM,
        "gmm_blackwell",
        "mosaic_gpu",
        platform="gpu",
        architectures=(10,),
        needs=BLACKWELL,
        formats=QUANTIZED_FORMATS,
        multiplies=f"4-bit rows by 4-bit experts; choose {FOUR_BIT}",
        prepares="prepare_weights",
        reads=GROUPED,  # no decode kernels: they multiply bf16 picks, not this kernel's 4-bit rows
        api=((MOSAIC_GPU, BLACKWELL_API),),
        varying_operands=False,
        tiles="blackwell",
    ),
    Kernel(
        "blackwell_bf16",
        GEMM,
        "gmm_blackwell_bf16",
        "mosaic_gpu",
        platform="gpu",
        architectures=(10,),
        needs=BLACKWELL,
        dtypes=("bfloat16",),
        formats=QUANTIZED_FORMATS,
        multiplies=f"bfloat16 rows by 4-bit experts ({FOUR_BIT})",
        shape_check="shape_refusal",
        reads=GROUPED,
        decode=("triton",),
        api=((MOSAIC_GPU, BLACKWELL_API),),
        varying_operands=False,
        tiles="blackwell_bf16",
    ),
    Kernel(
        "interpret_tpu",
        GEMM,
        "gmm_pallas_tpu",
        "mosaic_tpu",
        interpreted=True,
        shape_check="shape_refusal",
        shape_formats=QUANTIZED_FORMATS,
        reads=GROUPED,
        decode=("interpret_tpu",),
        varying_operands=False,  # as the interpreted TPU decode set's (below)
        takes=("precision",),
        tiles="pallas_tpu",
    ),
    Kernel(
        "interpret_triton",
        GEMM,
        "gmm_pallas_gpu",
        "triton",
        interpreted=True,
        reads=GROUPED,
        decode=("interpret_triton",),
        takes=("precision",),
        tiles="triton",
    ),
)

# The paged attentions, each reading one device's pages of a paged KV cache (`paged_attention.py`;
# "xla", the gather of `moejax/model/paged.py`, is no kernel of this package).
_ATTENTIONS = (
    Kernel(
        "pallas_tpu",
        ATTENTION,
        "paged_attention",
        "mosaic_tpu",
        "attend",
        platform="tpu",
        reads=frozenset({"kv", "prefill"}),  # its softmax takes no sinks and masks no window
    ),
    Kernel(
        "mosaic_gpu",
        ATTENTION,
        "paged_attention_mgpu",
        "mosaic_gpu",
        "paged_attention",
        platform="gpu",
        architectures=(9, 10),
        needs="an NVIDIA Hopper or Blackwell GPU (TMA)",
        reads=frozenset({"windows", "latent"}),
        api=ATTENTION_API,
    ),
    Kernel(
        "interpret_mosaic_gpu",
        ATTENTION,
        "paged_attention_mgpu",
        "mosaic_gpu",
        "paged_attention",
        interpreted=True,
        reads=frozenset({"windows", "latent"}),
        api=ATTENTION_API,
    ),
)

# A decode step's fused kernels (`moejax/model/projections.py`, `sharding/experts.py`): Triton's pick
# GEMM (each row's experts by id, no sort), dense projections and top-k; Mosaic GPU's pick GEMM and
# dense projections and router on Hopper (the router's float32 logits as float32 FMAs: wgmma would
# take them as TF32); Mosaic TPU's experts as one call (each local expert's tiles against every row,
# an expert no row picked never read), its router and its attention's dense products. A set's router
# record refuses widths it cannot take (`shape_check`): XLA's router runs there.
PICKS = frozenset({"picks"})
HOPPER_BF16 = "bfloat16 rows only: Hopper's wgmma multiplies float32 as TF32 (10 mantissa bits, ~1e-3 off)"
_DECODES = (
    Kernel(
        "triton",
        DECODE,
        "gmm_picks",
        "triton",
        "pick_gemm",
        platform="gpu",
        reads=PICKS,
        dense="triton_linear",
        topk="triton_topk",
        tiles="pick_gemm",
    ),
    Kernel(
        "interpret_triton",
        DECODE,
        "gmm_picks",
        "triton",
        "pick_gemm",
        reads=PICKS,
        dense="interpret_triton_linear",
        topk="interpret_triton_topk",
        interpreted=True,
        varying_operands=False,  # as the interpreted TPU set's (below)
        tiles="pick_gemm",
    ),
    Kernel(
        "triton_linear",
        DECODE,
        "linear",
        "triton",
        "fused_linear",
        platform="gpu",
        tiles="fused_linear",
        latent_heads=True,
    ),
    Kernel(
        "interpret_triton_linear",
        DECODE,
        "linear",
        "triton",
        "fused_linear",
        interpreted=True,
        tiles="fused_linear",
        latent_heads=True,
    ),
    Kernel("triton_topk", DECODE, "routing", "triton", "topk_route", platform="gpu", tiles="topk_route"),
    Kernel("interpret_triton_topk", DECODE, "routing", "triton", "topk_route", interpreted=True, tiles="topk_route"),
    Kernel(
        "mosaic_gpu",
        DECODE,
        "gmm_picks_mgpu",
        "mosaic_gpu",
        "pick_gemm",
        platform="gpu",
        architectures=(9,),
        needs=HOPPER,
        dtypes=("bfloat16",),
        multiplies=f"{HOPPER_BF16}; triton multiplies float32 at full precision",
        reads=PICKS,
        dense="mosaic_gpu_linear",
        router="mosaic_gpu_router",
        api=((MOSAIC_GPU, PICKS_MOSAIC_GPU_API),),
        shape_check="shape_refusal",
        tiles="pick_gemm_mgpu",
    ),
    Kernel(
        "interpret_mosaic_gpu",
        DECODE,
        "gmm_picks_mgpu",
        "mosaic_gpu",
        "pick_gemm",
        dtypes=("bfloat16",),
        multiplies=HOPPER_BF16,
        reads=PICKS,
        dense="interpret_mosaic_gpu_linear",
        router="interpret_mosaic_gpu_router",
        interpreted=True,
        api=((MOSAIC_GPU, PICKS_MOSAIC_GPU_API),),
        shape_check="shape_refusal",
        tiles="pick_gemm_mgpu",
    ),
    Kernel(
        "mosaic_gpu_linear",
        DECODE,
        "linear_mgpu",
        "mosaic_gpu",
        "fused_linear",
        platform="gpu",
        architectures=(9,),
        needs=HOPPER,
        dtypes=("bfloat16",),
        multiplies=HOPPER_BF16,
        api=((MOSAIC_GPU, HOPPER_GEMM_API),),
        shape_check="shape_refusal",
        tiles="linear_mgpu",
    ),
    Kernel(
        "interpret_mosaic_gpu_linear",
        DECODE,
        "linear_mgpu",
        "mosaic_gpu",
        "fused_linear",
        dtypes=("bfloat16",),
        multiplies=HOPPER_BF16,
        interpreted=True,
        api=((MOSAIC_GPU, HOPPER_GEMM_API),),
        shape_check="shape_refusal",
        tiles="linear_mgpu",
    ),
    Kernel(
        "mosaic_gpu_router",
        DECODE,
        "route_mgpu",
        "mosaic_gpu",
        platform="gpu",
        architectures=(9,),
        needs=HOPPER,
        dtypes=("bfloat16",),
        multiplies="bfloat16 rows (its float32 logits are float32 FMAs)",
        api=((MOSAIC_GPU, PICKS_MOSAIC_GPU_API),),
        shape_check="shape_refusal",
        tiles="route_mgpu",
    ),
    Kernel(
        "interpret_mosaic_gpu_router",
        DECODE,
        "route_mgpu",
        "mosaic_gpu",
        dtypes=("bfloat16",),
        multiplies="bfloat16 rows (its float32 logits are float32 FMAs)",
        interpreted=True,
        api=((MOSAIC_GPU, PICKS_MOSAIC_GPU_API),),
        shape_check="shape_refusal",
        tiles="route_mgpu",
    ),
    Kernel(
        "pallas_tpu",
        DECODE,
        "expert_ffn_tpu",
        "mosaic_tpu",
        platform="tpu",
        formats=("unquantized",),
        multiplies="unquantized experts (4-bit ones take the grouped GEMM)",
        shape_check="shape_refusal",
        reads=PICKS | {"stack"},
        whole_ffn=True,
        dense="pallas_tpu_linear",
        router="pallas_tpu_router",
        tiles="expert_ffn_tpu",
    ),
    Kernel(
        "interpret_tpu",
        DECODE,
        "expert_ffn_tpu",
        "mosaic_tpu",
        formats=("unquantized",),
        multiplies="unquantized experts (4-bit ones take the grouped GEMM)",
        shape_check="shape_refusal",
        reads=PICKS | {"stack"},
        whole_ffn=True,
        dense="interpret_tpu_linear",
        router="interpret_tpu_router",
        interpreted=True,
        # The interpreter slices its scalar tables, which vary over the mesh, at the grid's indices,
        # which do not; jax's varying-axes check refuses that slice.
        varying_operands=False,
        tiles="expert_ffn_tpu",
    ),
    Kernel("pallas_tpu_router", DECODE, "route_tpu", "mosaic_tpu", platform="tpu"),
    # Its dense products (attention's q|k|v and output projection): weights read in their stack and
    # their model's shape (`reads`: "stack"); no gated activation (`shape_check`).
    Kernel(
        "pallas_tpu_linear",
        DECODE,
        "linear_tpu",
        "mosaic_tpu",
        "fused_linear",
        platform="tpu",
        shape_check="shape_refusal",
        reads=frozenset({"stack"}),
        tiles="linear_tpu",
    ),
    Kernel(
        "interpret_tpu_linear",
        DECODE,
        "linear_tpu",
        "mosaic_tpu",
        "fused_linear",
        shape_check="shape_refusal",
        reads=frozenset({"stack"}),
        interpreted=True,
        tiles="linear_tpu",
    ),
    Kernel("interpret_tpu_router", DECODE, "route_tpu", "mosaic_tpu", interpreted=True),
)

CATALOG = {(k.role, k.name): k for k in (*_GEMMS, *_ATTENTIONS, *_DECODES)}
if len(CATALOG) != len(_GEMMS) + len(_ATTENTIONS) + len(_DECODES):
    raise ImportError("two kernels of one role share a name")


def names(role: str) -> tuple[str, ...]:
    """The kernels of `role`, in the catalog's order."""
    return tuple(name for r, name in CATALOG if r == role)


def kernel(role: str, name: str) -> Kernel:
    """Kernel `name` of `role`, or a ValueError naming the known ones."""
    if (role, name) not in CATALOG:
        raise ValueError(f"unknown {role} backend {name!r}; expected one of {names(role)}")
    return CATALOG[role, name]


def gemm(name: str) -> Kernel:
    return kernel(GEMM, name)


def attention(name: str) -> Kernel:
    return kernel(ATTENTION, name)


def interpreted_twins(k: Kernel) -> list[Kernel]:
    """The kernels that run `k`'s function in Pallas' interpreter (for a refusal's hint)."""
    return [t for t in CATALOG.values() if t.interpreted and (t.role, t.module) == (k.role, k.module) and t is not k]


def triton_free_gpu_kernels() -> tuple[str, ...]:
    """The grouped GEMMs a GPU runs without Pallas's Triton backend."""
    return tuple(k.name for k in _GEMMS if k.backend in ("xla", "mosaic_gpu") and not k.interpreted)
