"""Compile the tests' tiny DeepSeek-V3 decode step (MLA, a shared expert, the Triton grouped GEMM)
for a compile-only H100 in each dtype of argv, as the engine jits it, and print the precision of
its products as one JSON line per dtype:
{"dtype", "dots": each XLA dot's operand precision ("highest,highest": `hlo.Instr.precision`), "cublas":
each cuBLAS call's, "triton_dots": each Pallas Triton dot (`tt.dot`) as its kernel's IR prints it,
"decode": the decode set the placement took}.
Run as a script, in its own process (test_precision.py): an XLA abort kills the process."""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402

from checkpoints.hf_config import from_hf_config  # noqa: E402
from moejax.base import targets  # noqa: E402
from moejax.compiled import hlo  # noqa: E402
from moejax.compiled.plan import decode_program  # noqa: E402
from moejax.config import Config, EngineConfig, LayoutConfig  # noqa: E402
from moejax.engine.programs import jit_program  # noqa: E402
from tests.hf_reference import hf_config  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"


def custom_calls(op, target: str) -> list:
    """The stablehlo custom calls to `target` in `op`, nested ones included."""
    found = []
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if (
                    child.operation.name == "stablehlo.custom_call"
                    and ir.StringAttr(child.attributes["call_target_name"]).value == target
                ):
                    found.append(child)
                found += custom_calls(child.operation, target)
    return found


def triton_dots(lowered) -> list[str]:
    """Each `tt.dot` of the program's Pallas Triton kernels, as printed from its serialized IR."""
    dots = []
    for call in custom_calls(lowered.compiler_ir("stablehlo").operation, TRITON_CALL):
        with triton_lowering._new_ir_context():
            module = ir.Module.parse(ir.StringAttr(call.attributes["mhlo.backend_config"]["ir"]).value_bytes)
            dots += [line.strip() for line in str(module).splitlines() if " tt.dot " in line]
    return dots


def precision(product: hlo.Instr) -> str:
    return ",".join(product.precision) or "default"


def products(dtype: str) -> dict:
    model = from_hf_config(hf_config("deepseek_v3").to_dict())
    config = Config(
        model=model, layout=LayoutConfig(devices=1), engine=EngineConfig(dtype=dtype), kernel="auto"
    ).validate()
    placement, step, args = decode_program(config, 8, 64, "cuda", devices=list(targets.devices("h100", 1)))
    with targets.lowering(*args):
        lowered = jit_program(step, dtype, placement.platform, decode=True, donate_argnums=1).lower(*args)
    instrs = hlo.parse(lowered.compile().as_text()).instrs  # fused dots included
    dots = [precision(i) for i in instrs if i.opcode == "dot"]
    cublas = [precision(i) for i in instrs if i.target == "__cublas$gemm"]
    return {
        "dtype": dtype,
        "dots": dots,
        "cublas": cublas,
        "triton_dots": triton_dots(lowered),
        "decode": placement.decode.kernel,
    }


if __name__ == "__main__":
    for dtype in sys.argv[1:]:
        print(json.dumps(products(dtype)), flush=True)
