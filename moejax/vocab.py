"""The closed vocabularies of a run, one tuple each.

Config validation and the CLI's `choices=` read these tuples; the kernels' words are also the
names of `pallas_kernels.catalog`'s records, which `tests/test_vocab.py` checks they equal (this
module cannot import the catalog). Placement names are not here: the placement registry
(`sharding.registry`) is their only list, since each name belongs to the class behind it.

This module imports nothing, so the CLI can build its parser without loading jax.
"""

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "glm_moe_dsa", "gpt_oss")
DTYPES = ("float32", "bfloat16")
# A run's dtype: "auto" is bfloat16 on accelerators (their native format, half the bytes of
# weights and KV cache) and float32 on XLA:CPU, the reference platform whose goldens are float32.
RUN_DTYPES = ("auto", *DTYPES)
ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax")  # topk_softmax: softmax over the k best logits
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")  # silu(gate) * up | gpt-oss's clamped (up + 1) * swish
# "unquantized": the experts stay in the run dtype (engine.dtype); the others are 4-bit formats.
EXPERT_FORMATS = ("unquantized", "nvfp4", "mxfp4")
QUANTIZED_FORMATS = EXPERT_FORMATS[1:]
# What `calc` and `analyze` count a full-size model's expert bytes in (no run dtype there).
STORAGE_FORMATS = ("bf16", *QUANTIZED_FORMATS)
# Grouped-GEMM backends (`--kernel`), one backend per name, the same as `--attention-kernel`'s where
# both have it: "auto" picks by platform (and a GPU's architecture: `moejax.base.platform`); "triton"
# is Pallas's Triton kernel (any NVIDIA GPU, while jax has Pallas's Triton backend), "mosaic_gpu"
# the Mosaic GPU one for Hopper (sm_90, bf16 rows); "blackwell" (4-bit rows) and "blackwell_bf16"
# (bf16 rows) multiply 4-bit experts on an sm_100 GPU; "pallas_tpu" Mosaic TPU's; "interpret_tpu"
# runs the TPU kernel in Pallas' interpreter on any platform, "interpret_triton" the Triton one.
# Each is a record of `pallas_kernels.catalog` (tests/test_vocab.py checks they agree).
KERNELS = (
    "auto",
    "xla",
    "pallas_tpu",
    "triton",
    "mosaic_gpu",
    "blackwell",
    "blackwell_bf16",
    "interpret_tpu",
    "interpret_triton",
)
# Paged-attention kernels (`--attention-kernel`): "auto" picks by platform (`moejax.base.platform`);
# JAX's ragged paged attention (Mosaic TPU: "pallas_tpu") and our Mosaic GPU paged decode attention
# ("mosaic_gpu": `pallas_kernels/paged_attention_mgpu.py`); "interpret_mosaic_gpu" runs the GPU one
# in JAX's Mosaic GPU interpreter on any platform. GQA only; the GPU one reads sinks and sliding
# windows, the TPU one not.
ATTENTION_KERNELS = ("auto", "xla", "pallas_tpu", "mosaic_gpu", "interpret_mosaic_gpu")
# Earlier names, by config field: old -> new. Config files and the CLI still take them (with a
# one-line note: `moejax.config.schema.current_name`). "pallas_gpu" meant Triton's grouped GEMM but
# our Mosaic GPU attention, "interpret_gpu" each of them interpreted; "interpret" the TPU kernel.
ALIASES = {
    "kernel": {"pallas_gpu": "triton", "interpret_gpu": "interpret_triton", "interpret": "interpret_tpu"},
    "attention_kernel": {"pallas_gpu": "mosaic_gpu", "interpret_gpu": "interpret_mosaic_gpu"},
}
ATTENTION_MODES = ("dp", "tp")  # data-parallel (requests split over devices) | tensor-parallel (heads)
SPLIT_MODES = ("tp", "replicated")  # dense layers and the shared expert: sliced or copied
DISPATCH_DTYPES = ("bf16", "nvfp4")  # how rows travel, where a placement sends rows to their experts
# Routing overrides (`--routing`): the router's own picks, k distinct experts drawn uniformly per
# row, experts dealt in turn, or the picks of a recorded trace (`replay:TRACE`).
ROUTING_MODES = ("natural", "even", "round_robin", "replay")
# How a run of identical layers executes (`engine.layer_loop`): one `lax.scan` over its stacked
# parameters (compile time flat in depth), or unrolled over each layer's own arrays (no per-layer
# slice copies: XLA:CPU copies every weight a scan step slices). "auto": unroll short runs on XLA:CPU.
LAYER_LOOPS = ("auto", "scan", "unroll")
