"""A TPU's decode kernels: the experts as one Mosaic TPU kernel (`expert_ffn_tpu`) and the router as
another (`route_tpu`). Interpreted, against float64 numpy and the XLA ops they replace; an expert no
row picked is never fetched; compiled for a v5e at Qwen3-30B-A3B's widths, one kernel each, the
experts read in their stack, nothing sorted; and a run's decode steps through them give the XLA
run's tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_only import on
from gemm_cases import tolerance

from moejax.compiled import hlo
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model.layers import rms_norm, silu_glu
from moejax.model.router import route
from pallas_kernels import catalog
from pallas_kernels.expert_ffn_tpu import Tiles, expert_ffn_tpu, expert_slots
from pallas_kernels.layered import LayerOf
from pallas_kernels.route_tpu import route_tpu
from sharding import make_placement

EXPERTS, LOCAL, OFFSET, K = 12, 8, 2, 2  # local experts [2, 10) of 12: picks of the others add nothing
D, F = 128, 192  # gate|up [128, 384]: three 128-column tiles


def expected(x, ids, weights, gate_up, down, gate_up_bias=None, down_bias=None) -> np.ndarray:
    """float64: each row's picks of local experts, weight * (down(silu(gate) * up) + down bias). bf16
    rows: rounded where the two-product path rounds (each product, plus its bias), the activation
    in bf16 as both paths compute it."""
    dtype = x.dtype
    rounded = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)  # noqa: E731
    x, gate_up, down = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, gate_up, down))
    bias = lambda b, e: 0 if b is None else np.asarray(b[e].astype(jnp.float32), np.float64)  # noqa: E731
    out = np.zeros_like(x)
    for t, (row_ids, row_weights) in enumerate(zip(np.asarray(ids), np.asarray(weights), strict=True)):
        for e, w in zip(row_ids - OFFSET, row_weights, strict=True):
            if not 0 <= e < LOCAL:
                continue
            y = rounded(rounded(x[t] @ gate_up[e]) + bias(gate_up_bias, e))
            gate, up = y[0::2], y[1::2]
            if dtype == jnp.bfloat16:
                h = np.asarray(silu_glu(*(jnp.asarray(a, dtype) for a in (gate, up))).astype(jnp.float32), np.float64)
            else:
                h = gate / (1 + np.exp(-gate)) * up
            out[t] += w * rounded(rounded(h @ down[e]) + bias(down_bias, e))
    return out


def picks(rows: int, seed: int) -> tuple[jax.Array, jax.Array]:
    """ids [rows, K] of distinct experts of all 12 (some outside the local ones), weights [rows, K]."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(rows)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.random((rows, K)), jnp.float32)


def normal(key: int, shape, dtype, scale=1.0) -> jax.Array:
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("tn",))
def interpreted(x, ids, weights, gate_up, down, gate_up_bias=None, down_bias=None, *, tn=128):
    return expert_ffn_tpu(
        x,
        ids,
        weights,
        gate_up,
        down,
        group_offset=OFFSET,
        act=silu_glu,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        tiles=Tiles(tn),
        precision="highest",
        interpret=True,
    )


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_row_is_its_picks_ffn_weighed_and_summed(dtype, rows, biases):
    x = normal(1, (rows, D), dtype)
    gate_up, down = normal(2, (LOCAL, D, 2 * F), dtype, 0.1), normal(3, (LOCAL, F, D), dtype, 0.1)
    bias = dict(gate_up_bias=normal(4, (LOCAL, 2 * F), dtype), down_bias=normal(5, (LOCAL, D), dtype)) if biases else {}
    ids, weights = picks(rows, seed=rows)
    out = interpreted(x, ids, weights, gate_up, down, **bias)
    assert out.shape == x.shape and out.dtype == x.dtype
    want = expected(x, ids, weights, gate_up, down, **bias)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, **tolerance(dtype))


def test_a_layer_is_read_in_its_stack():
    """Layer 1 of a stack [3, G, ...] (`LayerOf`, a traced index) multiplies as the layer itself."""
    x = normal(1, (4, D), jnp.float32)
    gate_up, down = normal(2, (3, LOCAL, D, 2 * F), jnp.float32, 0.1), normal(3, (3, LOCAL, F, D), jnp.float32, 0.1)
    ids, weights = picks(4, seed=7)
    out = interpreted(x, ids, weights, LayerOf(gate_up, jnp.int32(1)), LayerOf(down, jnp.int32(1)))
    np.testing.assert_allclose(
        np.asarray(out), expected(x, ids, weights, gate_up[1], down[1]), **tolerance(jnp.float32)
    )


def test_an_expert_no_row_picked_keeps_the_tiles_already_fetched():
    """slot[g] is g for a picked expert; an unpicked one takes the last picked expert before it (the
    pipeline holds its last tiles), or before any, the first picked one (whose first tiles come next)."""
    ids = jnp.asarray([[4, 7], [4, 11], [0, 9]], jnp.int32)  # local experts 2, 5, 7 picked (0, 11: others')
    assert expert_slots(ids, OFFSET, LOCAL).tolist() == [2, 2, 2, 2, 2, 5, 5, 7]
    assert expert_slots(jnp.asarray([[0, 1]], jnp.int32), OFFSET, LOCAL).tolist() == [0] * LOCAL  # none local


def test_a_gate_up_of_no_whole_number_of_tiles_is_refused():
    x, (ids, weights) = normal(1, (1, D), jnp.float32), picks(1, seed=0)
    gate_up, down = normal(2, (LOCAL, D, 96), jnp.float32), normal(3, (LOCAL, 48, D), jnp.float32)
    with pytest.raises(ValueError, match=r"a gate\|up width of 96 is no whole number of 128-column tiles"):
        interpreted(x, ids, weights, gate_up, down)


@pytest.mark.parametrize("rows", [1, 64])
def test_compiled_for_a_v5e_it_is_one_kernel_reading_the_layer_in_its_stack(rows):
    """Qwen3-30B-A3B's experts (128 of gate|up [2048, 1536] and down [768, 2048], bf16) of a stack of
    2 layers on a v5e: one Mosaic call, no sort and no scatter, no temporary of a weight's size."""
    stack = [on("v5e", (2, 128, 2048, 1536), jnp.bfloat16), on("v5e", (2, 128, 768, 2048), jnp.bfloat16)]
    args = (on("v5e", (rows, 2048), jnp.bfloat16), on("v5e", (rows, 8), jnp.int32), on("v5e", (rows, 8), jnp.float32))

    def step(x, ids, weights, gate_up, down, layer):
        gate_up, down = LayerOf(gate_up, layer), LayerOf(down, layer)
        return expert_ffn_tpu(x, ids, weights, gate_up, down, act=silu_glu, tiles=Tiles(512))

    compiled = jax.jit(step).lower(*args, *stack, on("v5e", (), jnp.int32)).compile()
    kinds = hlo.by_kind(hlo.launches(compiled.as_text()))
    assert kinds.get("custom-call tpu_custom_call") == 1, kinds
    assert not {"sort", "scatter", "gather"} & set(kinds), kinds
    assert compiled.memory_analysis().temp_size_in_bytes < 768 * 2048 * 2  # less than one expert's down matrix


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-glm4-moe"])  # softmax, topk_softmax, sigmoid
def test_the_router_kernel_gives_the_normed_rows_picks_and_weights_of_the_xla_router(name):
    """And the experts kernel's slot table of the picks, as `expert_slots` builds it in XLA."""
    c = preset(name)
    x, norm = normal(1, (5, c.hidden_size), jnp.float32), 1 + normal(2, (c.hidden_size,), jnp.float32, 0.1)
    p = {"router": normal(3, (c.hidden_size, c.num_experts), jnp.float32)}
    if c.router_bias:
        p["router_bias"] = normal(4, (c.num_experts,), jnp.float32)
    h, ids, weights, slot = route_tpu(
        x,
        norm,
        p["router"],
        k=c.num_experts_per_tok,
        eps=c.rms_norm_eps,
        scoring=c.router_scoring,
        bias=p.get("router_bias"),
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        precision="highest",
        interpret=True,
    )
    with jax.default_matmul_precision("highest"):
        want_h = rms_norm(x, norm, c.rms_norm_eps)
        want_ids, want_weights = route(p, want_h, c)
    # The norm's sum of squares in another order than XLA:CPU's (which varies with the host's vector
    # width): within an ulp or two.
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=3e-7, atol=0)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), **tolerance(jnp.float32))
    np.testing.assert_array_equal(np.asarray(slot), np.asarray(expert_slots(want_ids, 0, c.num_experts)))


def test_the_router_kernel_reads_its_layer_in_its_stacks():
    """Layer 2 of stacks of norms [3, D] and router weights [3, D, E] (`LayerOf`, a traced index)
    routes as the layer's own arrays."""
    c = preset("tiny-glm4-moe")
    norms = 1 + normal(1, (3, c.hidden_size), jnp.float32, 0.1)
    routers = normal(2, (3, c.hidden_size, c.num_experts), jnp.float32)
    x, layer = normal(3, (4, c.hidden_size), jnp.float32), jnp.int32(2)
    kw = dict(k=c.num_experts_per_tok, eps=c.rms_norm_eps, scoring=c.router_scoring, interpret=True)
    stacked = jax.jit(lambda i: route_tpu(x, LayerOf(norms, i), LayerOf(routers, i), **kw))(layer)
    own = jax.jit(lambda n, r: route_tpu(x, n, r, **kw))(norms[2], routers[2])
    for got, want in zip(stacked, own, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_on_a_mesh_the_router_kernel_writes_no_slot_table():
    """A mesh's device holds some experts, not the table's every one: `slots` False leaves it out (XLA
    builds each device's), the rows, picks and weights the same."""
    c = preset("tiny-glm4-moe")
    x, norm = normal(1, (4, c.hidden_size), jnp.float32), 1 + normal(2, (c.hidden_size,), jnp.float32, 0.1)
    router = normal(3, (c.hidden_size, c.num_experts), jnp.float32)
    kw = dict(k=c.num_experts_per_tok, eps=c.rms_norm_eps, scoring=c.router_scoring, interpret=True)
    *without, table = route_tpu(x, norm, router, slots=False, **kw)
    assert table is None
    for got, want in zip(without, route_tpu(x, norm, router, **kw)[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("rows", [1, 64])
def test_compiled_for_a_v5e_the_router_is_one_kernel_with_no_sort(rows):
    """Qwen3-30B-A3B's router (hidden 2,048, 128 experts, top-8 softmax) on a v5e."""

    def router(x, norm, w):
        return route_tpu(x, norm, w, k=8, eps=1e-6, scoring="softmax", norm_topk_prob=True)

    args = (
        on("v5e", (rows, 2048), jnp.bfloat16),
        on("v5e", (2048,), jnp.bfloat16),
        on("v5e", (2048, 128), jnp.float32),
    )
    kinds = hlo.by_kind(hlo.launches(jax.jit(router).lower(*args).compile().as_text()))
    assert kinds.get("custom-call tpu_custom_call") == 1 and "sort" not in kinds, kinds


@pytest.mark.parametrize("fmt", ["nvfp4", "unquantized"])
def test_a_tpu_decode_set_takes_unquantized_experts_a_whole_number_of_tiles_wide(fmt):
    """kernel interpret_tpu: its decode steps' experts run as one call where the set multiplies the
    experts (unquantized, a gate|up a whole number of 128-column tiles wide), else through the grouped
    GEMM (the TPU grouped GEMM's 4-bit experts: K of 256 columns)."""
    model = dataclasses.replace(preset("tiny-mixtral"), hidden_size=256, moe_intermediate_size=256)
    config = Config(
        model=model, layout=LayoutConfig(devices=1), weights=WeightsConfig(fmt), kernel="interpret_tpu"
    ).validate()
    decode = make_placement(config).decode
    unquantized = fmt == "unquantized"
    assert (decode.kernel, decode.whole_ffn) == (("interpret_tpu", True) if unquantized else ("xla", False))
    assert decode.router == ("interpret_tpu_router" if unquantized else None)
    narrow = dataclasses.replace(config, model=preset("tiny-qwen3-moe"), weights=WeightsConfig())  # gate|up 64 wide
    assert make_placement(narrow).decode.kernel == "xla"
    assert "a gate|up width of 64" in catalog.kernel(catalog.DECODE, "interpret_tpu").why_not(
        "cpu", None, "float32", "unquantized", [(64, 64, True)]
    )


@pytest.mark.parametrize(
    "name, devices, loop", [("tiny-mixtral", 1, "auto"), ("tiny-gpt-oss", 1, "scan"), ("tiny-mixtral", 8, "auto")]
)
def test_a_run_whose_decode_steps_take_the_tpu_kernels_gives_the_xla_runs_tokens(name, devices, loop):
    """Kernel interpret_tpu (each pass of up to 128 rows through the one-call experts, the router
    kernel and the dense kernel's q|k|v and output projection, under a mesh each device its local
    experts and its own rows; on one device with the experts' slot table, over a scan the router's
    and attention's weights read in the run's stacks) and kernel xla: the same greedy tokens.
    gpt-oss: biases (attention's too), clamped SwiGLU, top-k softmax over biased logits."""

    def tokens(kernel: str) -> list:
        config = Config(
            model=preset(name),
            layout=LayoutConfig(devices=devices, placement="expert_sharded"),
            kernel=kernel,
            engine=EngineConfig(page_size=4, max_seq_len=32, dtype="float32", layer_loop=loop),
        ).validate()
        run = make_placement(config)
        assert run.decode.whole_ffn == (kernel == "interpret_tpu")
        assert (run.decode.router is not None) == (kernel == "interpret_tpu")
        assert ("attention" in run.decode.dense) == (kernel == "interpret_tpu")  # q|k|v and out: `linear_tpu`
        engine = Engine(config, load_params(config, run, seed=1), run)
        return engine.generate([[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]], 4).tokens

    assert tokens("interpret_tpu") == tokens("xla")
