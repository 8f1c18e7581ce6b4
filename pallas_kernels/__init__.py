"""4-bit expert formats and the kernels (the grouped GEMMs, the decode kernels, the paged attentions:
one record each in `catalog`)."""

from pallas_kernels.formats import (
    FORMATS,
    QuantizedArray,
    dequantize,
    nbytes,
    quantize,
    quantize_experts,
    quantize_rows,
    values_nbytes,
)
from pallas_kernels.registry import (
    expert_ffn,
    for_kernel,
    fused_linear,
    grouped_gemm,
    pick_gemm,
    route,
    run_weights,
    topk_route,
)

__all__ = [
    "FORMATS",
    "QuantizedArray",
    "dequantize",
    "expert_ffn",
    "for_kernel",
    "fused_linear",
    "grouped_gemm",
    "nbytes",
    "pick_gemm",
    "quantize",
    "quantize_experts",
    "quantize_rows",
    "route",
    "run_weights",
    "topk_route",
    "values_nbytes",
]
