"""4-bit expert formats and the grouped GEMM (XLA, Pallas TPU, Pallas GPU backends)."""

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
    for_kernel,
    grouped_gemm,
    pick_gemm,
    run_weights,
    shape_refusal,
    triton_refusal,
    unavailable,
)

__all__ = [
    "FORMATS",
    "QuantizedArray",
    "dequantize",
    "for_kernel",
    "grouped_gemm",
    "shape_refusal",
    "triton_refusal",
    "unavailable",
    "nbytes",
    "pick_gemm",
    "quantize",
    "quantize_experts",
    "quantize_rows",
    "run_weights",
    "values_nbytes",
]
