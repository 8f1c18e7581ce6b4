"""The HLO reader (`moejax.compiled.hlo`) on a hand-written XLA:GPU-like program: the ops one call
runs, how many times, which of them are kernel launches, and which write arrays of given shapes;
and on a second, its Pallas kernels, products' precision, collectives and host transfers; and a
compiled Triton call's programs. (Its pricing, `hlo_ops.ops`: `test_target_costs.py`; on compiled
programs: `test_target_structure.py`.)"""

import ast
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from compile_only import lower, on_h100

from moejax.compiled import hlo
from pallas_kernels import linear

# A decode step at batch 1 against a weight w [16, 32] (and a norm's [32]): x * w spelled out as a
# multiply of w's size and a reduce, an async all-gather, a copy pair, a cuBLAS GEMM over the
# gathered rows, a sort, a conditional of two branches, an async Triton call, a called computation
# and a loop of 3 trips (a counter from 0 while < 3) around a Triton kernel and a transposed copy
# of w. The loop's trip count is XLA's to state (`KNOWN`).
KNOWN = ', backend_config={"known_trip_count":{"n":"3"}}'
PROGRAM = """HloModule step, entry_computation_layout={(f32[1,16]{1,0}, f32[16,32]{1,0}, f32[32]{0})->f32[8,32]{1,0}}

%fused_mul (p0: f32[1,16], p1: f32[16,32]) -> f32[16,32] {
  %p0 = f32[1,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  %b = f32[16,32]{1,0} broadcast(%p0), dimensions={0,1}
  ROOT %m = f32[16,32]{1,0} multiply(%b, %p1)
}

%less (l0: f32[], l1: f32[]) -> pred[] {
  %l0 = f32[] parameter(0)
  %l1 = f32[] parameter(1)
  ROOT %lo = pred[] compare(%l0, %l1), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_reduce (r0: f32[16,32]) -> f32[1,32] {
  %r0 = f32[16,32]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %r = f32[32]{0} reduce(%r0, %zero), dimensions={0}, to_apply=%add
  ROOT %rb = f32[1,32]{1,0} bitcast(%r)
}

%fused_norm (n0: f32[1,32], n1: f32[32]) -> f32[1,1,32] {
  %n0 = f32[1,32]{1,0} parameter(0)
  %n1 = f32[32]{0} parameter(1)
  %nb = f32[1,32]{1,0} bitcast(%n1)
  %nm = f32[1,32]{1,0} multiply(%n0, %nb)
  ROOT %nr = f32[1,1,32]{2,1,0} bitcast(%nm)
}

%then (t0: f32[8,32]) -> f32[8,32] {
  %t0 = f32[8,32]{1,0} parameter(0)
  ROOT %tn = f32[8,32]{1,0} negate(%t0)
}

%else (e0: f32[8,32]) -> f32[8,32] {
  %e0 = f32[8,32]{1,0} parameter(0)
  ROOT %ec = f32[8,32]{1,0} copy(%e0)
}

%wrapped (w0: f32[8,32]) -> f32[8,32] {
  %w0 = f32[8,32]{1,0} parameter(0)
  ROOT %wk = f32[8,32]{1,0} custom-call(%w0), custom_call_target="__gpu$xla.gpu.triton"
}

%callee (c0: f32[8,32]) -> f32[8,32] {
  %c0 = f32[8,32]{1,0} parameter(0)
  ROOT %cf = f32[8,32]{1,0} fusion(%c0), kind=kLoop, calls=%then
}

%body (arg: (s32[], f32[8,32], f32[16,32])) -> (s32[], f32[8,32], f32[16,32]) {
  %arg = (s32[], f32[8,32]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %h = f32[8,32]{1,0} get-tuple-element(%arg), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%arg), index=2
  %k = f32[8,32]{1,0} custom-call(%h, %i), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="step/moe/gemm"}
  %wt = f32[32,16]{0,1} copy(%w), metadata={op_name="step/transpose"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,32]{1,0}, f32[16,32]{1,0}) tuple(%next, %k, %w)
}

%cond (carg: (s32[], f32[8,32], f32[16,32])) -> pred[] {
  %carg = (s32[], f32[8,32]{1,0}, f32[16,32]{1,0}) parameter(0)
  %counter = s32[] get-tuple-element(%carg), index=0
  %bound = s32[] constant(3)
  ROOT %lt = pred[] compare(%counter, %bound), direction=LT
}

ENTRY %main (x: f32[1,16], w: f32[16,32], norm: f32[32]) -> f32[8,32] {
  %x = f32[1,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %norm = f32[32]{0} parameter(2)
  %mul = f32[16,32]{1,0} fusion(%x, %w), kind=kLoop, calls=%fused_mul, metadata={op_name="step/attention/dot"}
  %red = f32[1,32]{1,0} fusion(%mul), kind=kInput, calls=%fused_reduce, metadata={op_name="step/attention/dot"}
  %normed = f32[1,1,32]{2,1,0} fusion(%red, %norm), kind=kLoop, calls=%fused_norm
  %flat = f32[1,32]{1,0} bitcast(%normed)
  %ag = (f32[1,32]{1,0}, f32[8,32]{1,0}) all-gather-start(%flat), replica_groups=[1,8]<=[8], dimensions={0}
  %rows = f32[8,32]{1,0} all-gather-done(%ag)
  %cp = (f32[8,32]{1,0}, f32[8,32]{1,0}, u32[]) copy-start(%rows)
  %moved = f32[8,32]{1,0} copy-done(%cp)
  %gemm = f32[8,32]{1,0} custom-call(%moved, %moved), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
  %sorted = f32[8,32]{1,0} sort(%gemm), dimensions={1}, to_apply=%less
  %pred = pred[] constant(true)
  %picked = f32[8,32]{1,0} conditional(%pred, %sorted, %sorted), true_computation=%then, false_computation=%else
  %as = ((f32[8,32]{1,0}), f32[8,32]{1,0}, u32[]) async-start(%picked), calls=%wrapped
  %done = f32[8,32]{1,0} async-done(%as), calls=%wrapped
  %called = f32[8,32]{1,0} call(%done), to_apply=%callee
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,32]{1,0}, f32[16,32]{1,0}) tuple(%zero, %called, %w)
  %loop = (s32[], f32[8,32]{1,0}, f32[16,32]{1,0}) while(%init), condition=%cond, body=%body{KNOWN}
  ROOT %out = f32[8,32]{1,0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


def program(known: bool) -> str:
    return PROGRAM.replace("{KNOWN}", KNOWN if known else "")


def test_runs_are_the_ops_a_call_runs_not_those_fused_into_fusions():
    """Each instruction of the entry, the loop's body and condition, the branches and the called
    computations, not those inside fusions, with its result's shapes, kind, target and scope."""
    runs = {(r.computation, r.instr.name): r for r in hlo.parse(program(known=True)).runs}
    assert len(runs) == 22 + 9 + 4 + 2 + 2 + 2 + 2  # entry, body, cond, then, else, wrapped, callee
    assert not {name for _, name in runs} & {"m", "r", "nm", "rb"}  # fused
    mul, ag, k = runs["main", "mul"].instr, runs["main", "ag"].instr, runs["body", "k"].instr
    assert (mul.opcode, mul.shapes, mul.fusion_kind, mul.scope) == (
        "fusion",
        [(16, 32)],
        "kLoop",
        "step/attention/dot",
    )
    assert ag.shapes == [(1, 32), (8, 32)] and ag.kind == "all-gather-start"
    assert (k.target, k.kind, k.scope) == (
        "__gpu$xla.gpu.triton",
        "custom-call __gpu$xla.gpu.triton",
        "step/moe/gemm",
    )


@pytest.mark.parametrize("known", [True, False])
def test_runs_count_loop_trips_condition_evaluations_and_branches(known):
    """A loop's body runs its trip count (XLA's, or its condition's bound: 0 while < 3), its
    condition once more, a conditional's branches half a time each, a called computation once."""
    counts = {(r.computation, r.instr.name): r.count for r in hlo.parse(program(known)).runs}
    assert counts["body", "k"] == 3 and counts["cond", "lt"] == 4
    assert counts["then", "tn"] == counts["else", "ec"] == 0.5
    assert counts["main", "mul"] == counts["callee", "cf"] == counts["wrapped", "wk"] == 1
    (loop,) = hlo.loops(program(known))
    assert hlo.known_trip_count(loop.instr) == (3 if known else None)


@pytest.mark.parametrize("known", [True, False])
def test_launches_are_the_kernels_xla_gpu_runs(known):
    """Fusions, custom calls, copies, collectives (an async pair once), sorts, each branch's share,
    an async op's wrapped kernel, a called computation's, the loop body's 3 times; its condition
    4 times only where XLA does not know the trip count. Not: parameters, constants, bitcasts,
    tuples, the second halves of async pairs, the loop, conditional, call and async-start."""
    launches = hlo.launches(program(known))
    assert hlo.by_kind(launches) == {
        "custom-call __gpu$xla.gpu.triton": 1 + 3,  # wrapped, the loop's
        "fusion kLoop": 3,  # mul, normed, callee's
        "copy": 3 + 0.5,  # the loop's transposed w, the else branch's
        "add": 3,  # the loop's counter
        "fusion kInput": 1,
        "all-gather-start": 1,
        "copy-start": 1,
        "custom-call __cublas$gemm": 1,
        "sort": 1,
        "negate": 0.5,
        **({} if known else {"compare": 4}),
    }


@pytest.mark.parametrize(
    "shapes, found",
    [
        ([(16, 32)], ["mul"]),  # w spelled out by the multiply; its transposed copy laid out [32, 16]
        ([(32, 16)], ["wt"]),
        ([(32,)], []),  # a norm weight: an activation's [1, 1, 32] is not it
        ([(1, 16, 32, 1)], ["mul"]),  # sizes of 1 aside
    ],
)
def test_weight_shaped_are_writes_of_a_weights_shape_as_laid_out(shapes, found):
    assert [r.instr.name for r in hlo.weight_shaped(program(True), shapes)] == found


@pytest.mark.parametrize(
    "ordered, found",
    [(False, ["mul", "wt"]), (True, ["mul"])],  # sorted sizes: a copy however transposed
)
def test_writes_of_shapes_any_tuple_element_free_ops_aside(ordered, found):
    """An op writing an array of a given shape, in any element of its result; parameters,
    get-tuple-elements, tuples and the loop that carry w are not writes."""
    assert [r.instr.name for r in hlo.writes_of(program(True), [(16, 32)], ordered)] == found
    assert [r.instr.name for r in hlo.writes_of(program(True), [(1, 32)])] == ["red", "normed", "ag"]


def test_products_are_dots_and_gemms_not_a_multiply_and_reduce():
    """The cuBLAS GEMM computes a product; x * w spelled out as a multiply and a reduce does not."""
    assert [r.instr.name for r in hlo.products(program(True))] == ["gemm"]


# Pallas kernels of each compiler as XLA prints their calls (op_name, operand layouts, backend
# configs: Mosaic GPU's holds the kernel's IR, here with a "{" of its own), a cuBLAS GEMM and a dot
# at HIGHEST, an async all-gather and an all-reduce, a callback and an outfeed; an XLA:CPU YNNPACK fusion.
KERNELS = r"""HloModule kernels

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[8,32], sinks: f32[2]) -> bf16[64,32] {
  %x = bf16[8,32]{1,0} parameter(0)
  %sinks = f32[2]{0} parameter(1)
  %t = bf16[8,32]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jit(grouped_gemm)/pallas_call"}, backend_config={grid_x = 4 : i32, ir = "ML\EFR\22", name = "_kernel", num_warps = 4 : i32}
  %m = bf16[8,32]{1,0} custom-call(%t, %sinks), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={bf16[8,32]{1,0}, f32[2]{0}}, metadata={op_name="jit(step)/attention/grid_8x4/paged_attention_mgpu/mpmd_map"}, backend_config={kernel_hash = "\C4", module = "{ wgmma.mma_async"}
  %p = bf16[8,32]{1,0} custom-call(%m), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={}}, metadata={op_name="jit(step)/jit(ragged_paged_attention)/ragged_paged_attention_kernel/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzv","cost_estimate":{"flops":"1024"}}}
  %g = bf16[8,32]{1,0} custom-call(%p, %p), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]}}}
  %d = f32[8,8]{1,0} dot(%g, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, operand_precision={highest,highest}
  %ar = f32[8,8]{1,0} all-reduce(%d), replica_groups={{0,1}}, to_apply=%add
  %ag = (bf16[8,32]{1,0}, bf16[64,32]{1,0}) all-gather-start(%g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %gathered = bf16[64,32]{1,0} all-gather-done(%ag)
  %cb = () custom-call(%ar), custom_call_target="xla_ffi_python_cpu_callback", custom_call_has_side_effect=true
  %token = token[] after-all()
  %out = token[] outfeed(%sinks, %token), outfeed_shape=f32[2]{0}
  %y = f32[8,8]{1,0} fusion(%d), kind=kCustom, calls=%add, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %r = bf16[64,32]{1,0} copy(%gathered)
}
"""  # noqa: E501


def test_pallas_calls_are_each_compilers_kernels_by_name():
    """Triton's, Mosaic GPU's and Mosaic TPU's calls, by their custom call's target; each kernel's
    name is the named scope its call was traced under (a jit's name unwrapped). cuBLAS is no Pallas kernel."""
    calls = [(r.instr.name, r.instr.pallas, r.instr.kernel) for r in hlo.pallas_calls(KERNELS)]
    assert calls == [
        ("t", "triton", "grouped_gemm"),
        ("m", "mosaic_gpu", "paged_attention_mgpu"),
        ("p", "mosaic_tpu", "ragged_paged_attention_kernel"),
    ]


def test_a_pallas_calls_programs_function_and_operand_bytes():
    """A Triton call's programs are its config's grid; a Mosaic GPU call's, its grid scope's; a
    call's operand bytes, its layout constraints' arrays'."""
    i = {r.instr.name: r.instr for r in hlo.parse(KERNELS).runs}
    assert [(i[n].programs, i[n].function) for n in "tmpg"] == [(4, "_kernel"), (32, ""), (0, ""), (0, "")]
    assert i["m"].operand_bytes == 8 * 32 * 2 + 2 * 4


def test_a_compiled_triton_calls_programs():
    """On a real compiled program (a compile-only H100's): a fused_linear of 2 rows x [256, 96] in
    column tiles of 16, one row tile and K whole runs as 96 / 16 = 6 programs, reading x, the weight and the norm."""
    tiles = linear.Tiles(n=16, k=64, m=16, num_warps=4, num_stages=2, splits=1)
    call = jax.jit(lambda x, w, norm: linear.fused_linear(x, (w,), norm=norm, tiles=tiles))
    args = (on_h100((2, 256), jnp.bfloat16), on_h100((256, 96), jnp.bfloat16), on_h100((256,), jnp.bfloat16))
    (run,) = hlo.pallas_calls(lower(call, *args).compile().as_text())
    assert (run.instr.programs, run.instr.function) == (6, "_linear_kernel")
    assert run.instr.operand_bytes == (2 * 256 + 256 * 96 + 256) * 2


def test_a_calls_backend_config_operand_types_and_precision():
    """Backend configs whole, braces in their IR's strings aside; a call's operands' types; a dot's
    and a cuBLAS GEMM's precision, the default's none."""
    i = {r.instr.name: r.instr for r in hlo.parse(KERNELS).runs}
    assert json.loads(i["p"].backend_config)["custom_call_config"]["cost_estimate"] == {"flops": "1024"}
    assert i["m"].backend_config == '{kernel_hash = "\\C4", module = "{ wgmma.mma_async"}'
    assert i["t"].backend_config.endswith("num_warps = 4 : i32}")
    assert i["m"].operand_types == ["bf16[8,32]", "f32[2]"] and i["t"].operand_types == []
    assert i["g"].precision == i["d"].precision == ("highest", "highest") and i["ar"].precision == ()
    assert (i["ag"].dtypes, i["x"].dtypes) == (["bf16", "bf16"], ["bf16"])


def test_collectives_and_host_transfers():
    """An async collective once (its start), in program order; a callback's custom call and an outfeed."""
    assert [(r.instr.name, r.instr.collective) for r in hlo.collectives(KERNELS)] == [
        ("ar", "all-reduce"),
        ("ag", "all-gather"),
    ]
    assert [r.instr.name for r in hlo.host_transfers(KERNELS)] == ["cb", "out"]
    assert hlo.host_transfers(PROGRAM.replace("{KNOWN}", "")) == []


def test_fusion_kinds_of_xla_gpu_and_xla_cpu():
    """XLA:CPU's custom fusions' kind is their backend config's (XLA:GPU's: the first test's)."""
    assert [(r.instr.name, r.instr.kind) for r in hlo.launches(KERNELS) if r.instr.opcode == "fusion"] == [
        ("y", "fusion __ynn_fusion")
    ]


def test_instrs_are_every_computations_fused_ones_included():
    assert {"m", "r", "nm", "rb", "k", "mul"} <= {i.name for i in hlo.parse(program(True)).instrs}


def test_tests_read_compiled_programs_through_this_reader():
    """No other test parses a compiled program's custom calls itself: no string in them names a
    custom call's target attribute or its op as HLO text prints them, but for hand-written
    programs ("HloModule ..."), which they hand to this reader. (This file's own strings are the
    reader's tests and the needles.)"""
    needles = ("custom_call_target", "custom-call(", "custom-call\\(")
    found, programs = [], 0
    paths = sorted(p for p in Path(__file__).parent.glob("*.py") if p.name != Path(__file__).name)
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("HloModule"):
                    programs += 1
                elif any(n in node.value for n in needles):
                    found.append(f"{path.name}:{node.lineno}")
    assert len(paths) > 50 and programs >= 1  # the tests, and test_target_costs' program, looked through
    assert found == []
