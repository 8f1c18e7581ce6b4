"""grouped_gemm: XLA path against numpy; Pallas kernels (interpreted) against XLA; exports."""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on, on_h100

import pallas_kernels as pk
from moejax import targets
from moejax.config import Config, EngineConfig, LayoutConfig, preset
from moejax.model.layers import ClampedSwiGLU, silu_glu
from moejax.plan import decode_program
from moejax.platform import resolve
from pallas_kernels import epilogue
from pallas_kernels.gmm_pallas_gpu import gmm_pallas_gpu
from pallas_kernels.gmm_pallas_tpu import gmm_pallas_tpu
from pallas_kernels.layered import LayerOf, split


def make_case(seed: int, scenario: str, dtype, m=45, k=128, n=256, groups=6, local=None):
    """Returns lhs [M, K], rhs [G_local, K, N] f32, group_sizes [G], group_offset."""
    rng = np.random.default_rng(seed)
    local = local or groups
    if scenario == "one_group":  # one group holds every row, the others are empty
        sizes = np.zeros(groups, np.int32)
        sizes[rng.integers(groups)] = m
    else:  # ragged sizes with empty groups; some trailing rows belong to no group
        sizes = rng.multinomial(m - 5, rng.dirichlet(np.ones(groups) * 0.5)).astype(np.int32)
        sizes[rng.choice(groups, 2, replace=False)] = 0
    offset = rng.integers(groups - local + 1) if scenario == "offset" else 0
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((local, k, n)) / np.sqrt(k), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes), int(offset)


def reference(lhs, rhs_f32, sizes, offset):
    """numpy: out[r] = lhs[r] @ rhs[g - offset] for rows of local groups g, else 0."""
    lhs, rhs_f32, sizes = (np.asarray(a, np.float32) for a in (lhs, rhs_f32, sizes))
    out = np.zeros((lhs.shape[0], rhs_f32.shape[2]), np.float32)
    ends = np.cumsum(sizes).astype(int)
    for j in range(rhs_f32.shape[0]):
        lo, hi = ends[offset + j] - sizes[offset + j], ends[offset + j]
        out[int(lo) : hi] = lhs[int(lo) : hi] @ rhs_f32[j]
    return out


def weights(rhs_f32, fmt, dtype):
    """The rhs as passed to grouped_gemm, and its exact f32 value for the reference."""
    if fmt == "dense":
        w = rhs_f32.astype(dtype)
        return w, w.astype(jnp.float32)
    q = pk.quantize(rhs_f32, fmt)
    return q, pk.dequantize(q)


def tolerance(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)


# Rows: a prefill's many (the loop over touched groups) and a decode step's few (gathered per row).
ROWS = [70, 12]


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("scenario", ["ragged", "one_group", "offset"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_matches_numpy(fmt, scenario, m):
    lhs, rhs, sizes, offset = make_case(
        0, scenario, jnp.float32, m=m, n=48, groups=8, local=3 if scenario == "offset" else None
    )
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    expected = reference(lhs, w_f32, sizes, offset)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[int(sizes.sum()) :], 0.0)  # rows past the sum


def test_xla_bf16_traced_offset_and_out_dtype():
    lhs, rhs, sizes, _ = make_case(1, "ragged", jnp.bfloat16, m=33, n=32, groups=8)
    w = rhs[2:6].astype(jnp.bfloat16)
    f = jax.jit(lambda l, w, s, o: pk.grouped_gemm(l, w, s, group_offset=o, preferred_element_type=jnp.float32))
    out = f(lhs, w, sizes, jnp.int32(2))
    assert out.dtype == jnp.float32 and pk.grouped_gemm(lhs, w, sizes).dtype == jnp.bfloat16
    np.testing.assert_allclose(out, reference(lhs, w.astype(jnp.float32), sizes, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", ROWS)
def test_xla_reads_only_touched_groups(m):
    """Weights of empty groups may hold NaN: they must never enter the result."""
    lhs, rhs, sizes, _ = make_case(2, "ragged", jnp.float32, m=m, n=32, groups=8)
    poisoned = jnp.where((sizes == 0)[:, None, None], jnp.nan, rhs)
    out = pk.grouped_gemm(lhs, poisoned, sizes, backend="xla")
    np.testing.assert_allclose(out, reference(lhs, rhs, sizes, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_xla_never_converts_all_groups(fmt):
    """Compiled HLO: no [G, K, N]-sized convert or decode outside the group loop (XLA:CPU
    would otherwise hoist it and read every group's weights on every call)."""
    w = jax.ShapeDtypeStruct((6, 128, 80), jnp.bfloat16)  # [G, K, N], distinctive dims
    if fmt != "dense":
        w = jax.eval_shape(lambda a: pk.quantize(a, fmt), w)
    hlo = (
        jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla"))
        .lower(jax.ShapeDtypeStruct((16, 128), jnp.bfloat16), w, jax.ShapeDtypeStruct((6,), jnp.int32))
        .compile()
        .as_text()
    )
    entry = hlo[hlo.index("ENTRY") :]
    assert not re.search(r"= \w+\[6,(128|64),80\]\S* (fusion|convert)", entry)


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_reads_groups_of_a_layer_stack(fmt, m):
    """One layer of a stack [L, G, K, N] (LayerOf): the layer's result, and compiled, no
    [G, K, N] copy of the layer (XLA:CPU copies a sliced layer whole before the group loop)."""
    lhs, rhs, sizes, _ = make_case(7, "ragged", jnp.float32, m=m, n=80, groups=6)
    stack = jnp.stack([rhs * 2, rhs])  # [2, G, K, N]
    w, w_f32 = weights(stack, fmt, jnp.float32)
    f = jax.jit(lambda l, w, s, i: pk.grouped_gemm(l, LayerOf(w, i), s, backend="xla"))
    np.testing.assert_allclose(f(lhs, w, sizes, jnp.int32(1)), reference(lhs, w_f32[1], sizes, 0), rtol=1e-5, atol=1e-5)
    hlo = f.lower(lhs, w, sizes, jnp.int32(1)).compile().as_text()
    assert not re.search(r"= \w+\[6,(128|64),80\]", hlo)


@pytest.mark.parametrize("fmt,act", [("dense", None), ("nvfp4", None), ("nvfp4", "swiglu")])
def test_gpu_kernel_reads_a_layer_of_a_stack(fmt, act):
    """One layer of a stack [L, G, K, N] (LayerOf) through the Triton kernel (interpreted), local
    groups at an offset: the result of the layer as its own array (its weights, block scales,
    tensor scales and, NVFP4 gate|up, column scales: each layer's its own)."""
    lhs, rhs, sizes, offset = make_case(9, "offset", jnp.float32, m=40, n=48, groups=6, local=3)
    stack = jnp.stack([rhs * 2, rhs, rhs * 3])  # [3, G, K, N]
    w = stack if fmt == "dense" else pk.quantize_experts(stack, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((3, 48)), jnp.float32)
    run = jax.jit(
        lambda w: pk.grouped_gemm(
            lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS.get(act), backend="interpret_gpu"
        )
    )
    np.testing.assert_array_equal(run(LayerOf(w, jnp.int32(1))), run(jax.tree.map(lambda a: a[1], w)))


def test_gpu_decode_step_copies_no_layer_of_experts():
    """A scanned run's decode step on an H100 (engine.layer_loop scan) hands the Triton kernel each layer's experts
    where they lie in the run's stack [L, E, K, N]: no instruction of the compiled step makes an array
    of one layer's [E, K, N] (a dynamic-slice fusion copied each layer out of the stack every step)."""
    model = dataclasses.replace(preset("tiny-qwen3-moe"), num_layers=4)  # a run of 2 identical MoE layers
    config = Config(
        model=model, layout=LayoutConfig(devices=1), engine=EngineConfig(dtype="bfloat16", layer_loop="scan")
    )
    placement, step, args = decode_program(config.validate(), 8, 64, "cuda", devices=list(targets.devices("h100", 1)))
    stacks = [a.shape for run in args[0]["layers"] if "moe" in run for a in run["moe"]["experts"].values()]
    assert placement.kernel == "pallas_gpu" and max(shape[0] for shape in stacks) == 2
    hlo = jax.jit(step).lower(*args).compile().as_text()
    layer = "|".join(",".join(map(str, shape[1:])) for shape in stacks)
    made = [
        line
        for line in hlo.splitlines()
        if (m := re.search(r"= (\(.*?\)|\S+) ([\w-]+)\(", line))
        and m.group(2) not in ("parameter", "get-tuple-element", "bitcast", "tuple")
        and re.search(rf"bf16\[(1,)?({layer})\]", m.group(1))
    ]
    assert not made, made[:3]


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize("m", ROWS)
def test_xla_multiplies_groups_held_a_buffer_each(fmt, m):
    """A layer held a buffer per group (`Groups`): the stack's result; and row at a time (12 rows
    over 6 groups), no group's [K, N] is copied out of its buffer before its products."""
    lhs, rhs, sizes, _ = make_case(8, "ragged", jnp.float32, m=m, n=80, groups=6)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    groups = jax.jit(split)(w)  # a buffer per group, as an engine holds them
    f = jax.jit(lambda l, w, s: pk.grouped_gemm(l, w, s, backend="xla"))
    np.testing.assert_allclose(f(lhs, groups, sizes), reference(lhs, w_f32, sizes, 0), rtol=1e-5, atol=1e-5)
    if fmt == "dense" and m < 6 * 4:
        hlo = f.lower(lhs, groups, sizes).compile().as_text()
        assert not re.search(r"= f32\[(\d+,)*128,80\]\S* (copy|fusion|gather|dynamic-slice|slice)\(", hlo)


def test_xla_decode_and_prefill_chunking():
    """One row per group (decode) and many rows per group (prefill, full + power-of-2 chunks)."""
    for m, sizes in [(8, [1, 0, 1, 1, 0, 1, 2, 1]), (600, [300, 0, 1, 150, 149, 0, 0, 0])]:
        lhs, rhs, _, _ = make_case(3, "ragged", jnp.float32, m=m, n=16, k=64, groups=8)
        sizes = jnp.asarray(sizes, jnp.int32)
        out = pk.grouped_gemm(lhs, rhs, sizes, backend="xla")
        np.testing.assert_allclose(out, reference(lhs, rhs, sizes, 0), rtol=1e-4, atol=1e-4)


# The XLA path as an accelerator runs it (`moejax.platform.Platform.gemm_rows`): a decode step's few rows a
# product each (one gather on a GPU, a slice per row on a TPU), a prefill's many in a loop of tiles.
ACCELERATORS = ["gpu", "tpu"]


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [12, 300])
def test_xla_on_accelerators_matches_numpy(platform, fmt, m):
    """Layer 1 of a stack (`LayerOf`), local groups at an offset: the layer's product; rows of other
    groups and past the last zero (tests/test_target_structure.py: no loop whose trip count
    depends on the picks, compiled for an H100)."""
    lhs, rhs, sizes, offset = make_case(
        zlib.crc32(f"{platform}/{fmt}/{m}".encode()), "offset", jnp.float32, m=m, n=48, groups=8, local=3
    )
    w, w_f32 = weights(jnp.stack([rhs * 2, rhs]), fmt, jnp.float32)
    f = jax.jit(
        lambda l, w, s, i: pk.grouped_gemm(
            l, LayerOf(w, i), s, group_offset=offset, backend="xla", gemm_rows=resolve(platform).gemm_rows
        )
    )
    out = f(lhs, w, sizes, jnp.int32(1))
    np.testing.assert_allclose(out, reference(lhs, w_f32[1], sizes, offset), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize("platform", ACCELERATORS)
@pytest.mark.parametrize("tokens", [3, 40])  # 12 picks, one product each; 160, in tiles
def test_xla_on_accelerators_finishes_products_as_the_loop(platform, tokens):
    """A gate|up product of each pick's token row (bias, activation) and the down product summed into
    the tokens (bias, weights) as an accelerator runs them: XLA:CPU's group loop's results."""
    lhs, w, sizes, offset, combine, bias, expected = picks_case(tokens, tokens, "nvfp4")
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, backend="xla")
    np.testing.assert_allclose(
        run(combine=combine, gemm_rows=resolve(platform).gemm_rows), expected, rtol=1e-5, atol=1e-5
    )
    up, w_up, up_sizes, up_offset, up_bias = glu_case("nvfp4", jnp.float32, n=96)
    rows = jnp.asarray(np.random.default_rng(tokens).integers(0, up.shape[0], 4 * tokens), jnp.int32)
    up_sizes = jnp.asarray(np.random.default_rng(1).multinomial(4 * tokens, np.ones(6) / 6), jnp.int32)
    glu = functools.partial(
        pk.grouped_gemm,
        up,
        w_up,
        up_sizes,
        group_offset=up_offset,
        bias=up_bias,
        act=silu_glu,
        lhs_rows=rows,
        backend="xla",
    )
    np.testing.assert_allclose(glu(gemm_rows=resolve(platform).gemm_rows), glu(), rtol=1e-5, atol=1e-5)


# Each kernel sees every format, both dtypes and every scenario, spread over six cases.
KERNEL_CASES = [
    ("dense", jnp.bfloat16, "offset"),
    ("dense", jnp.float32, "one_group"),
    ("nvfp4", jnp.bfloat16, "ragged"),
    ("nvfp4", jnp.float32, "offset"),
    ("mxfp4", jnp.bfloat16, "one_group"),
    ("mxfp4", jnp.float32, "ragged"),
]
KERNELS = {
    "interpret": functools.partial(gmm_pallas_tpu, interpret=True),
    "interpret_gpu": functools.partial(gmm_pallas_gpu, interpret=True),
}


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt,dtype,scenario", KERNEL_CASES)
def test_pallas_kernel_matches_xla(backend, fmt, dtype, scenario):
    seed = zlib.crc32(f"{backend}/{fmt}/{scenario}".encode())  # fresh inputs per case
    lhs, rhs, sizes, offset = make_case(seed, scenario, dtype, local=3 if scenario == "offset" else None)
    w, _ = weights(rhs, fmt, dtype)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend=backend)
    expected = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    assert out.shape == expected.shape and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
def test_column_tensor_scales_of_a_gate_up_stack(backend):
    """NVFP4 gate_up experts carry one tensor scale per half (column-wise [G, 1, N]): every
    backend applies each column's own, as the dequantized weights hold it."""
    lhs, rhs, sizes, offset = make_case(8, "offset", jnp.float32, m=40, n=128, groups=6, local=3)
    w = pk.quantize_experts(rhs * jnp.array([1.0, 40.0] * 64), "nvfp4", gated=True)
    assert w.tensor_scale.shape == (3, 1, 128)
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend=backend)
    np.testing.assert_allclose(out, reference(lhs, pk.dequantize(w), sizes, offset), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_pallas_kernel_accumulates_over_k_tiles(backend, fmt):
    lhs, rhs, sizes, _ = make_case(4, "ragged", jnp.float32, m=20, k=256, n=128)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    out = jax.jit(lambda l, w, s: KERNELS[backend](l, w, s, 0, jnp.float32, tk=64))(lhs, w, sizes)
    np.testing.assert_allclose(out, reference(lhs, w_f32, sizes, 0), rtol=1e-5, atol=1e-5)


GLU_ACTS = {"swiglu": silu_glu, "clamped_swiglu": ClampedSwiGLU(alpha=1.702, limit=7.0)}
# Each backend runs both activations, every format and both dtypes over these three cases.
GLU_CASES = [
    ("dense", jnp.float32, "swiglu"),
    ("nvfp4", jnp.bfloat16, "clamped_swiglu"),
    ("mxfp4", jnp.float32, "clamped_swiglu"),
]


def glu_case(fmt, dtype, n=512):
    """A gate|up grouped GEMM's operands: rows, a gate_up stack (NVFP4: a tensor scale per half),
    group sizes, offset, a bias [G_local, N]."""
    lhs, rhs, sizes, offset = make_case(zlib.crc32(f"glu/{fmt}".encode()), "offset", dtype, n=n, local=3)
    w = rhs.astype(dtype) if fmt == "dense" else pk.quantize_experts(rhs, fmt, gated=True)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((3, n)), dtype)
    return lhs, w, sizes, offset, bias


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("fmt,dtype,act", GLU_CASES)
def test_glu_epilogue_matches_xla(backend, fmt, dtype, act):
    """A gate|up product with its bias and (clamped) SwiGLU applied in the kernel's epilogue
    equals the XLA path's product, bias and activation (f32: to 1e-5; bf16: the Triton
    epilogue's activation math is f32, XLA's bf16)."""
    lhs, w, sizes, offset, bias = glu_case(fmt, dtype)
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS[act])
    out, expected = run(backend=backend), run(backend="xla")
    assert out.shape == expected.shape == (lhs.shape[0], w.shape[2] // 2) and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))


@pytest.mark.parametrize("backend", list(KERNELS))
def test_glu_epilogue_writes_half_the_columns(backend):
    """The kernel itself writes [rows, N/2]: the activation is not applied after it."""
    lhs, w, sizes, offset, bias = glu_case("nvfp4", jnp.float32)
    jaxpr = jax.make_jaxpr(
        lambda: pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, act=silu_glu, backend=backend)
    )()
    calls = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    assert [c.outvars[0].aval.shape[1] for c in calls] == [w.shape[2] // 2]


# Widths no Triton block (a power of two) divides: (K, N, format, dtype, activation). The Triton
# kernel masks its edge tiles: K 40 in one masked tile of 64, N 24 in one of 32, gate|up N 48 as
# 24 pairs in one tile of 32; NVFP4 K 96 as two K-halves of 48 in one masked tile of 64 (its
# scale blocks masked with them); MXFP4 K 64 (a whole tile) and N 40.
ODD_WIDTHS = [
    (40, 24, "dense", jnp.bfloat16, None),
    (40, 24, "dense", jnp.float32, None),
    (40, 24, "dense", jnp.bfloat16, "swiglu"),
    (40, 48, "dense", jnp.float32, "swiglu"),
    (96, 40, "nvfp4", jnp.bfloat16, "swiglu"),
    (64, 40, "mxfp4", jnp.float32, None),
]


@pytest.mark.parametrize("k,n,fmt,dtype,act", ODD_WIDTHS)
def test_gpu_kernel_takes_any_width(k, n, fmt, dtype, act):
    """The Triton kernel (interpreted) at widths its blocks do not divide equals the XLA path:
    rows over two row tiles, local groups at an offset, a bias and column scales (NVFP4 gate|up:
    a tensor scale per half) in the epilogue; rows of no local group stay zero."""
    lhs, rhs, sizes, offset = make_case(
        zlib.crc32(f"odd/{k}/{n}/{fmt}".encode()), "offset", dtype, m=70, k=k, n=n, local=3
    )
    w = rhs.astype(dtype) if fmt == "dense" else pk.quantize_experts(rhs, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((3, n)), dtype) if act else None
    run = functools.partial(pk.grouped_gemm, lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS.get(act))
    out, expected = run(backend="interpret_gpu"), run(backend="xla")
    assert out.shape == expected.shape == (70, n // 2 if act else n) and out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[int(sizes.sum()) :], 0.0)


@pytest.mark.parametrize(
    "k,n,fmt,act", [(40, 24, "dense", None), (40, 48, "dense", "swiglu"), (96, 40, "nvfp4", "swiglu")]
)
def test_gpu_kernel_compiles_for_h100_at_any_width(k, n, fmt, act):
    """Triton takes only power-of-two blocks: the kernel compiles for an H100 at widths none
    divides (whole-width tiles were refused: "Encountered an array of shape (32, 40)")."""
    w = on_h100((8, k, n), jnp.bfloat16)
    if fmt != "dense":
        w = jax.tree.map(
            lambda a: on_h100(a.shape, a.dtype),
            jax.eval_shape(lambda a: pk.quantize_experts(a, fmt, gated=act is not None), w),
        )
    f = jax.jit(
        lambda l, w, s, o, b: pk.grouped_gemm(
            l, w, s, group_offset=o, bias=b, act=GLU_ACTS.get(act), backend="pallas_gpu"
        )
    )
    hlo = (
        f.lower(
            on_h100((12, k), jnp.bfloat16),
            w,
            on_h100((8,), jnp.int32),
            on_h100((), jnp.int32),
            on_h100((8, n), jnp.bfloat16) if act else None,
        )
        .compile()
        .as_text()
    )
    assert "__gpu$xla.gpu.triton" in hlo and f"bf16[12,{n // 2 if act else n}]" in hlo


@pytest.mark.parametrize(
    "fmt,dtype,act", [("dense", jnp.bfloat16, None), ("nvfp4", jnp.float32, "swiglu"), ("mxfp4", jnp.bfloat16, None)]
)
def test_tpu_kernel_reads_a_layer_of_a_stack(fmt, dtype, act):
    """The TPU kernel (interpreted) on layer i of a stack [L, G, K, N] (a `LayerOf`, read where it
    lies) equals the XLA path on that layer at each i: groups at an offset, 4-bit tensor scales
    (NVFP4 gate|up: one per half, column-wise), a bias and the activation in its epilogue."""
    lhs, rhs, sizes, offset = make_case(zlib.crc32(f"stack/{fmt}".encode()), "offset", dtype, local=3)
    stack = jnp.stack([rhs * (1 + i) for i in range(3)])  # [3, 3, K, N]
    w = stack.astype(dtype) if fmt == "dense" else pk.quantize_experts(stack, fmt, gated=act is not None)
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((3, rhs.shape[2])), dtype) if act else None
    run = jax.jit(
        lambda l, w, s, i, backend: pk.grouped_gemm(
            l, LayerOf(w, i), s, group_offset=offset, bias=bias, act=GLU_ACTS.get(act), backend=backend
        ),
        static_argnames="backend",
    )
    for i in (0, 2):
        out, expected = (run(lhs, w, sizes, jnp.int32(i), backend=b) for b in ("interpret", "xla"))
        assert out.shape == expected.shape and out.dtype == expected.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), **tolerance(dtype))


@pytest.mark.parametrize("fmt,dtype,act", GLU_CASES)
def test_xla_loop_activates_each_chunk_without_writing_the_product(fmt, dtype, act):
    """The XLA group loop finishes each chunk (its group's bias) and applies the activation as it
    goes: the [M, N/2] of the product with bias and activation applied after it, and no [M, N]."""
    lhs, w, sizes, offset, bias = glu_case(fmt, dtype)
    m, n = lhs.shape[0], w.shape[2]
    run = jax.jit(
        lambda: pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, act=GLU_ACTS[act], backend="xla")
    )
    product = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, backend="xla")
    expected = epilogue.glu(
        *epilogue.gate_up_columns(epilogue.finish(product, dtype, None, epilogue.group_rows(bias, sizes, offset, m))),
        GLU_ACTS[act],
    )
    assert run().dtype == dtype
    np.testing.assert_allclose(
        np.asarray(run(), np.float32),
        np.asarray(expected, np.float32),
        **(tolerance(dtype) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)),
    )
    assert not re.search(rf"\[{m},{n}\]", run.lower().compile().as_text())


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
@pytest.mark.parametrize("m", ROWS)
def test_lhs_rows_reads_each_rows_token(backend, m):
    """lhs_rows: a gate|up product (bias, activation) of rows lhs[lhs_rows] without the caller
    gathering them; the XLA loop gathers each chunk's rows, never the [M, K] they make."""
    lhs, w, sizes, offset, bias = glu_case("dense", jnp.float32)
    tokens = lhs[:9]  # [T, K]: rows repeat, as a token's k picks do
    lhs_rows = jnp.asarray(np.random.default_rng(m).integers(0, 9, m), jnp.int32)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(m, np.ones(sizes.shape[0]) / sizes.shape[0]), jnp.int32)
    run = jax.jit(
        lambda x, r: pk.grouped_gemm(
            x, w, sizes, group_offset=offset, bias=bias, act=silu_glu, lhs_rows=r, backend=backend
        )
    )
    expected = pk.grouped_gemm(
        tokens[lhs_rows], w, sizes, group_offset=offset, bias=bias, act=silu_glu, backend=backend
    )
    np.testing.assert_allclose(run(tokens, lhs_rows), expected, rtol=1e-6, atol=1e-6)
    if backend == "xla" and m > 16:  # the group loop (few rows take one batched product)
        assert f"f32[{m},{lhs.shape[1]}]" not in run.lower(tokens, lhs_rows).compile().as_text()


def picks_case(seed: int, tokens: int, fmt: str, k=4, groups=8, local=3, d=64, n=48):
    """T tokens' k picks sorted by expert, as `moe_local` hands them to the down product: lhs
    [T*k, d], rhs [local, d, n] (experts [offset, offset + local) of `groups`), group sizes,
    offset, (order [T*k], weights [T, k]), bias [local, n], and the expected [T, n] in numpy."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(groups, k, replace=False) for _ in range(tokens)])  # [T, k]
    order = np.argsort(ids.reshape(-1), kind="stable")
    rows = rng.standard_normal((tokens * k, d)).astype(np.float32)  # each pick's row, in pick order
    pick_weights = rng.random((tokens, k)).astype(np.float32)
    rhs = jnp.asarray(rng.standard_normal((local, d, n)) / np.sqrt(d), jnp.float32)
    w, w_f32 = weights(rhs, fmt, jnp.float32)
    bias, offset = rng.standard_normal((local, n)).astype(np.float32), 2
    expected = np.zeros((tokens, n), np.float32)
    for t, j in np.ndindex(tokens, k):
        if offset <= ids[t, j] < offset + local:
            e = ids[t, j] - offset
            expected[t] += pick_weights[t, j] * (rows[t * k + j] @ np.asarray(w_f32[e]) + bias[e])
    sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=groups), jnp.int32)
    combine = (jnp.asarray(order, jnp.int32), jnp.asarray(pick_weights))
    return jnp.asarray(rows[order]), w, sizes, offset, combine, jnp.asarray(bias), expected


@pytest.mark.parametrize("backend", ["xla", *KERNELS])
@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
@pytest.mark.parametrize(
    "tokens", [3, 40]
)  # a decode step's few picks, a prefill's many (the XLA loop sums them itself)
def test_combine_sums_each_tokens_weighted_picks(backend, fmt, tokens):
    """A down product with combine: each token's picks of local experts, plus their bias,
    weighted and summed into the token's row; picks of other experts add nothing."""
    lhs, w, sizes, offset, combine, bias, expected = picks_case(
        zlib.crc32(f"{backend}/{fmt}/{tokens}".encode()), tokens, fmt
    )
    out = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, combine=combine, backend=backend)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("as_groups", [False, True])  # a layer's stack, or a buffer per group (row at a time)
def test_xla_loop_sums_picks_without_writing_the_product(as_groups):
    """The XLA loop adds each chunk into its tokens' rows: no [T*k, N] buffer in its program,
    and the same sums as the product followed by `epilogue.combine`."""
    lhs, w, sizes, offset, combine, bias, _ = picks_case(5, 40, "dense")
    rhs = split(w) if as_groups else w
    run = jax.jit(lambda l, r, s, c, b: pk.grouped_gemm(l, r, s, group_offset=offset, bias=b, combine=c, backend="xla"))
    hlo = run.lower(lhs, rhs, sizes, combine, bias).compile().as_text()
    assert f"f32[{lhs.shape[0]},{w.shape[2]}]" not in hlo and f"f32[40,{w.shape[2]}]" in hlo
    unfused = pk.grouped_gemm(lhs, w, sizes, group_offset=offset, bias=bias, backend="xla")
    np.testing.assert_allclose(
        run(lhs, rhs, sizes, combine, bias), epilogue.combine(unfused, *combine), rtol=1e-5, atol=1e-5
    )


# Each target's grouped-GEMM kernel and the custom call it compiles to.
TARGET_KERNELS = {"v5e": ("pallas_tpu", "tpu_custom_call"), "h100": ("pallas_gpu", "__gpu$xla.gpu.triton")}


def target_gemm(target: str, fmt: str, m: int = 256, k: int = 2048, n: int = 512, act=None):
    """One grouped GEMM [m, k] x [8, k, n] lowered for a compile-only device of `target` with its
    kernel ("nvfp4 gate_up": a gate_up stack's tensor scales, one per half; act: a gate|up
    product's activation, with a bias, in the epilogue)."""
    backend = TARGET_KERNELS[target][0]
    w = jax.ShapeDtypeStruct((8, k, n), jnp.bfloat16)
    if fmt != "dense":
        w = jax.eval_shape(lambda a: pk.quantize_experts(a, fmt.split()[0], gated=fmt.endswith("gate_up")), w)
    w = jax.tree.map(lambda a: on(target, a.shape, a.dtype), w)
    bias = jnp.zeros((8, n), jnp.bfloat16) if act is not None else None
    f = jax.jit(lambda l, w, s, o: pk.grouped_gemm(l, w, s, group_offset=o, backend=backend, bias=bias, act=act))
    return f.lower(on(target, (m, k), jnp.bfloat16), w, on(target, (32,), jnp.int32), on(target, (), jnp.int32))


@pytest.mark.parametrize("target", list(TARGET_KERNELS))
@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "mxfp4", "nvfp4 gate_up"])
def test_hardware_kernels_compile_for_their_targets(target, fmt):
    """The kernels compile for their hardware (Mosaic TPU / Triton) at production-like sizes;
    "gate_up": NVFP4 with a tensor scale per half (column-wise)."""
    assert TARGET_KERNELS[target][1] in target_gemm(target, fmt).compile().as_text()


@pytest.mark.parametrize("target", list(TARGET_KERNELS))
@pytest.mark.parametrize("act", list(GLU_ACTS))
def test_glu_epilogue_compiles_for_its_target(target, act):
    """The kernels with the activation in their epilogue compile for their hardware, writing
    [rows, N/2] (a gate_up stack of Qwen3-30B-A3B's width, F = 768, NVFP4)."""
    lowered = target_gemm(target, "nvfp4 gate_up", n=1536, act=GLU_ACTS[act])
    assert "tensor<256x768xbf16>" in lowered.as_text()
    assert TARGET_KERNELS[target][1] in lowered.compile().as_text()


@pytest.mark.parametrize("fmt,k", [("nvfp4", 256), ("nvfp4", 512), ("nvfp4", 768), ("mxfp4", 512)])
def test_tpu_kernel_takes_k_whose_scale_rows_fill_no_tile(fmt, k):
    """Where no K tile's scale rows fill Mosaic's 32-row tile of 8-bit data (a tensor-sliced
    expert's K of 256 on 8 devices), K is one step and its scale rows one block: it compiles for a
    v5e and, interpreted, gives the XLA path's products."""
    assert TARGET_KERNELS["v5e"][1] in target_gemm("v5e", fmt, m=64, k=k, n=512).compile().as_text()
    lhs = jax.random.normal(jax.random.key(0), (40, k), jnp.float32)
    rhs = pk.quantize_experts(jax.random.normal(jax.random.key(1), (4, k, 256), jnp.float32), fmt)
    sizes = jnp.array([10, 0, 20, 10], jnp.int32)
    np.testing.assert_allclose(
        pk.grouped_gemm(lhs, rhs, sizes, backend="interpret"),
        pk.grouped_gemm(lhs, rhs, sizes, backend="xla"),
        rtol=1e-5,
        atol=1e-4,
    )


def test_tpu_kernel_tells_xla_its_cost():
    """The pallas_call carries a cost estimate, as megablox's does, so XLA can schedule around it."""
    config = target_gemm("v5e", "dense", m=256, k=2048, n=512).as_text().replace("\\22", '"').replace("\\0A", "")
    assert re.search(rf'"cost_estimate": {{[^}}]*"flops":{2 * 256 * 2048 * 512}\b', config)


def test_auto_backend_and_bad_names():
    lhs, rhs, sizes, _ = make_case(5, "ragged", jnp.float32, m=16, n=64, k=64)
    assert jax.default_backend() == "cpu"
    np.testing.assert_array_equal(pk.grouped_gemm(lhs, rhs, sizes), pk.grouped_gemm(lhs, rhs, sizes, backend="xla"))
    with pytest.raises(ValueError, match="unknown grouped_gemm backend"):
        pk.grouped_gemm(lhs, rhs, sizes, backend="cuda")
    with pytest.raises(ValueError, match="axis=-2"):
        pk.grouped_gemm(lhs, pk.quantize(jnp.swapaxes(rhs, 1, 2), "nvfp4", axis=-1), sizes)
