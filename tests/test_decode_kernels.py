"""The fused decode kernels a GPU's decode step runs (`moejax.base.platform.DecodeKernels`), here in
Pallas's interpreter: a layer's dense products (`moejax.model.projections`: attention's q|k|v and
output, the router, a dense MLP, with each family's options: q/k norms, biases, a router's bias and
sigmoid scoring) give the values of the XLA ops every other pass runs, and a whole run (its experts
multiplied by pick) the XLA run's greedy tokens. Float32 at full precision on both sides."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.base.platform import DENSE_GROUPS, XLA, DecodeKernels
from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params
from moejax.model import projections
from moejax.model.layers import rope_cos_sin
from pallas_kernels import catalog, tiles
from sharding import make_placement

# The fused kernels in the interpreter, for every dense pass of up to 128 rows and experts' of up to
# 256, a layer's dense weights on its one device; tiles: the table's defaults ("", 0).
FUSED = DecodeKernels(
    "interpret_triton",
    rows=128,
    pick_rows=256,
    precision="highest",
    device=("", 0),
    dense=frozenset(DENSE_GROUPS),
    linear="interpret_triton_linear",
    topk="interpret_triton_topk",
)
ROWS = 3  # a decode step of three requests
PRESETS = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-mixtral"]  # q/k norms; biases and sinks; neither


def close(fused, xla):
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(xla), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5, atol=2e-5)


def normal(key: int, shape, scale=1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


@functools.cache
def attention_params(name: str) -> tuple:
    """(model config, random GQA attention weights of its widths with the options it has)."""
    c = preset(name)
    d, h, hkv, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    p = {"q": normal(1, (d, h, dh), 0.2), "k": normal(2, (d, hkv, dh), 0.2), "v": normal(3, (d, hkv, dh), 0.2)}
    p["o"] = normal(4, (h, dh, d), 0.2)
    if c.attention_bias:
        p |= {"q_bias": normal(5, (h, dh)), "k_bias": normal(6, (hkv, dh)), "v_bias": normal(7, (hkv, dh))}
    if c.o_bias:
        p["o_bias"] = normal(8, (d,))
    if c.qk_norm:
        p |= {"q_norm": 1 + normal(9, (dh,), 0.1), "k_norm": 1 + normal(10, (dh,), 0.1)}
    return c, p


@pytest.mark.parametrize("name", PRESETS)
def test_qkv_is_the_normed_projected_rotated_rows(name):
    c, p = attention_params(name)
    x, norm = normal(11, (ROWS, 1, c.hidden_size)), 1 + normal(12, (c.hidden_size,), 0.1)
    cos_sin = rope_cos_sin(c, jnp.array([[3], [17], [40]], jnp.int32))
    close(projections.qkv(FUSED, p, x, norm, cos_sin, c), projections.qkv(XLA, p, x, norm, cos_sin, c))


@pytest.mark.parametrize("name", PRESETS)
def test_out_is_the_residual_plus_the_output_projection(name):
    c, p = attention_params(name)
    attended = normal(13, (ROWS, 1, c.num_heads, c.head_dim))
    residual = normal(14, (ROWS, 1, c.hidden_size))
    close(projections.out(FUSED, p, attended, residual, c), projections.out(XLA, p, attended, residual, c))


@functools.cache
def latent_params(name: str) -> tuple:
    """(model config, random MLA attention weights of its widths, a DSA indexer's among them)."""
    c = preset(name)
    d, h, r, lr = c.hidden_size, c.num_heads, c.qk_rope_head_dim, c.kv_lora_rank
    p = {
        "q_a": normal(31, (d, c.q_lora_rank), 0.2),
        "q_a_norm": 1 + normal(32, (c.q_lora_rank,), 0.1),
        "q_b": normal(33, (c.q_lora_rank, h, c.qk_head_dim), 0.2),
        "kv_a": normal(34, (d, lr + r), 0.2),
        "kv_a_norm": 1 + normal(35, (lr,), 0.1),
        "o": normal(36, (h, c.v_head_dim, d), 0.2),
    }
    if c.is_dsa:
        hi, di = c.index_n_heads, c.index_head_dim
        p["indexer"] = {
            "wq": normal(37, (c.q_lora_rank, hi, di), 0.2),
            "wk": normal(38, (d, di), 0.2),
            "k_norm": 1 + normal(39, (di,), 0.1),
            "k_norm_bias": normal(40, (di,), 0.1),
            "head_weights": normal(41, (d, hi), 0.2),
        }
    return c, p


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm-5.3"])
def test_latent_is_mlas_projections(name):
    """MLA's queries (rope parts rotated, interleaved), normed latent, rotated rope key and a DSA
    indexer's keys, queries and head weights: two launches and the XLA ops' values."""
    c, p = latent_params(name)
    x, norm = normal(42, (ROWS, 1, c.hidden_size)), 1 + normal(43, (c.hidden_size,), 0.1)
    cos_sin = rope_cos_sin(c, jnp.array([[3], [17], [40]], jnp.int32))
    fused, xla = (projections.latent(decode, p, x, norm, cos_sin, c) for decode in (FUSED, XLA))
    assert (fused.index is None) == (not c.is_dsa)
    close(fused, xla)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3"])
def test_latent_out_is_the_residual_plus_the_output_projection(name):
    c, p = latent_params(name)
    attended = normal(44, (ROWS, 1, c.num_heads, c.v_head_dim))
    residual = normal(45, (ROWS, 1, c.hidden_size))
    close(projections.out(FUSED, p, attended, residual, c), projections.out(XLA, p, attended, residual, c))


DENSE_KERNELS = sorted({k.dense for k in catalog.CATALOG.values() if k.role == catalog.DECODE and k.dense})


@pytest.mark.parametrize("name", DENSE_KERNELS)
def test_mla_attention_runs_in_a_dense_kernel_that_takes_its_epilogues(name):
    """MLA's projections (heads of a width per segment, an interleaved rope past a head's first
    columns) go to a decode set's dense kernel only where its record says it takes them
    (`latent_heads`, Triton's); a kernel that does not refuses them with one error, and the placement
    leaves MLA's attention to XLA's ops there."""
    dense = catalog.kernel(catalog.DECODE, name)
    if dense.interpreted:  # runs here: the placement asks its record
        config = Config(model=preset("tiny-glm-5.3"), layout=LayoutConfig(devices=1), kernel="interpret_triton")
        decode_set = next(k for k in catalog.CATALOG.values() if k.role == catalog.DECODE and k.dense == name)
        assert make_placement(config.validate())._dense_takes(decode_set, "attention", "bfloat16") == dense.latent_heads
    if not dense.latent_heads:
        module = dense.kernel_module()
        x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
        chosen = module.Tiles(**tiles.lookup(dense.tiles, k=64, n=64))
        with pytest.raises(ValueError, match="one head_dim for every segment"):
            dense.load()(x, (w, w), head_dim=(16, 32), head_norms=(jnp.ones(16), None), tiles=chosen, interpret=True)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-glm4-moe"])
def test_route_picks_and_weighs_as_the_router(name):
    """The normed rows, the experts picked and their weights (softmax top-k, with a bias, or
    sigmoid scores with the bias for picking only, renormed and scaled)."""
    c = preset(name)
    d, e = c.hidden_size, c.num_experts
    p = {"router": normal(15, (d, e), 0.3)}
    if c.router_bias:
        p["router_bias"] = normal(16, (e,), 0.1)
    x, norm = normal(17, (ROWS, d)), 1 + normal(18, (d,), 0.1)
    (h, ids, weights, table), (h_xla, ids_xla, weights_xla, _) = (
        projections.route(decode, p, x, norm, c) for decode in (FUSED, XLA)
    )
    assert table is None  # a TPU's router kernel writes the experts' table; the GPU's writes none
    np.testing.assert_array_equal(ids, ids_xla)
    close((h, weights), (h_xla, weights_xla))


@pytest.mark.parametrize("residual", [False, True])
def test_mlp_is_gate_up_activated_then_down(residual):
    d, f = 64, 96
    p = {"gate_up": normal(19, (d, 2 * f), 0.2), "down": normal(20, (f, d), 0.2)}
    h, res = normal(21, (ROWS, 1, d)), normal(22, (ROWS, 1, d)) if residual else None
    one_device = lambda decode: types.SimpleNamespace(decode=decode, lies_whole=lambda group: True)  # noqa: E731
    close(projections.mlp(one_device(FUSED), p, h, res), projections.mlp(one_device(XLA), p, h, res))


def test_a_prefills_rows_take_the_xla_ops():
    """More rows than a decode step's go through XLA's GEMMs: the same function, the same values."""
    assert FUSED.fuses_dense(ROWS, "attention") and not FUSED.fuses_dense(FUSED.rows + 1, "attention")
    assert FUSED.fuses(FUSED.pick_rows) and not FUSED.fuses(FUSED.pick_rows + 1)
    assert not XLA.fuses_dense(1, "attention") and not XLA.fuses(1)


@pytest.mark.parametrize("name,fmt", [("tiny-qwen3-moe", "nvfp4"), ("tiny-gpt-oss", "unquantized")])
def test_a_run_in_the_decode_kernels_gives_the_xla_runs_tokens(name, fmt):
    """One device, kernel interpret_triton (the decode kernels in the interpreter; a prefill's rows
    through the grouped GEMM) and kernel xla: the same greedy tokens for requests of several lengths."""

    def tokens(kernel: str) -> list:
        config = Config(
            model=preset(name),
            layout=LayoutConfig(devices=1),
            kernel=kernel,
            weights=WeightsConfig(fmt),
            engine=EngineConfig(page_size=4, max_seq_len=32, dtype="float32"),
        ).validate()
        placement = make_placement(config)
        assert placement.decode.fuses(4) == (kernel == "interpret_triton")
        engine = Engine(config, load_params(config, placement, seed=1), placement)
        return engine.generate([[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]], 4).tokens

    assert tokens("interpret_triton") == tokens("xla")


def mesh_run(kernel: str, attention: str = "dp"):
    """tiny-qwen3-moe over 8 devices under expert_sharded: (its placement, an engine's greedy tokens)."""
    config = Config(
        model=preset("tiny-qwen3-moe"),
        layout=LayoutConfig(devices=8, placement="expert_sharded", attention=attention),
        kernel=kernel,
        engine=EngineConfig(page_size=4, max_seq_len=32, dtype="float32"),
    ).validate()
    placement = make_placement(config)
    engine = Engine(config, load_params(config, placement, seed=1), placement)
    return placement, engine.generate([[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]], 4).tokens


@pytest.mark.parametrize("attention,groups", [("dp", {"attention", "router"}), ("tp", {"router"})])
def test_on_a_mesh_the_groups_whose_weights_lie_whole_run_in_the_kernels(attention, groups):
    """Each device runs a kernel on its rows by the whole weights it holds: attention's under DP
    attention (not TP: its heads slice), the router's always; the MLPs slice (layout.dense "tp")."""
    config = Config(
        model=preset("tiny-qwen3-moe"), layout=LayoutConfig(devices=8, attention=attention), kernel="interpret_triton"
    )
    assert make_placement(config.validate()).decode.dense == groups


def test_a_run_in_the_decode_kernels_gives_the_xla_runs_tokens_on_a_mesh():
    """8 devices, expert_sharded, DP attention: q|k|v, the output projection and the router run in
    the interpreted kernels under shard_map, each device its requests; the tokens of kernel xla."""
    placement, fused = mesh_run("interpret_triton")
    assert placement.decode.fuses_dense(4, "attention") and placement.decode.per_device is not None
    assert fused == mesh_run("xla")[1]
