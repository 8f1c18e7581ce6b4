"""Experts in placement slots: any placement of the experts (permuted, replicated) gives the
checkpoint order's greedy tokens under every placement it applies to; a move carries every
leaf of an expert bit for bit; the checkpoint order itself is untouched."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import Config, ConfigError, LayoutConfig, WeightsConfig, preset
from moejax.engine.engine import Engine
from moejax.launch.loading import load_params, with_hf_model
from sharding import eplb, make_placement, moves, names, slots

GOLDEN = Path(__file__).parent / "golden"
GOLDENS = ("deepseek_v3", "qwen3_moe")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14], [20, 21, 22]]
NEW = 4
# Placements that hold whole experts on some devices; tensor_sliced holds every expert everywhere.
PLACED = [n for n in names() if n != "tensor_sliced"]


def config_for(model: str, layout: LayoutConfig, fmt: str = "unquantized") -> Config:
    if model in GOLDENS:
        return with_hf_model(Config(layout=layout, weights=WeightsConfig(fmt)), str(GOLDEN / model)).validate()
    return Config(model=preset(model), layout=layout, weights=WeightsConfig(fmt)).validate()


def load(model: str, config: Config, placement):
    return load_params(config, placement, hf_dir=str(GOLDEN / model) if model in GOLDENS else None, seed=1)


def random_phy2log(layers: int, num_logical: int, num_slots: int, seed: int) -> np.ndarray:
    """int[L, P]: every expert once, the spare slots random replicas, all in a random order."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            rng.permutation(
                np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_slots - num_logical)])
            )
            for _ in range(layers)
        ]
    )


def moe_layers(c) -> int:
    return c.num_layers - len(c.dense_layers)


@functools.cache
def placed(model: str, name: str, fmt: str, spare_per_device: int):
    """(placement, params in checkpoint order, params in a random placement, its phy2log)."""
    layout = LayoutConfig(devices=8, placement=name) if name else LayoutConfig()
    base = config_for(model, layout, fmt)
    ep = make_placement(base).ep
    config = config_for(model, LayoutConfig(**{**layout.__dict__, "redundant_experts": spare_per_device * ep}), fmt)
    placement = make_placement(config)
    params = load(model, config, placement)
    phy2log = random_phy2log(moe_layers(config.model), placement.num_logical, placement.num_experts, seed=7)
    moved, _ = moves.arrange(placement, params, eplb.contiguous(len(phy2log), placement.num_logical), phy2log)
    return config, placement, params, moved, phy2log


@functools.cache
def tokens(model: str, fmt: str = "unquantized", name: str = "", spare_per_device: int = 0):
    """Greedy tokens: the single-device checkpoint order (name ""), or `name` in a random placement."""
    if not name:
        config = config_for(model, LayoutConfig(), fmt)
        placement = make_placement(config)
        return Engine(config, load(model, config, placement), placement).generate(PROMPTS, NEW).tokens
    config, placement, _, moved, phy2log = placed(model, name, fmt, spare_per_device)
    return Engine(config, moved, placement, phy2log=phy2log).generate(PROMPTS, NEW).tokens


@pytest.mark.parametrize("name", PLACED)
@pytest.mark.parametrize("model", GOLDENS)
def test_golden_models_in_any_placement_give_checkpoint_order_tokens(model, name):
    assert tokens(model, name=name, spare_per_device=1) == tokens(model)


@pytest.mark.parametrize("name", PLACED)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_4bit_experts_in_any_placement_give_checkpoint_order_tokens(fmt, name):
    assert tokens("tiny", fmt, name, spare_per_device=1) == tokens("tiny", fmt)


def test_a_permutation_without_replicas_gives_checkpoint_order_tokens():
    assert tokens("tiny", name="expert_sharded") == tokens("tiny")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_moved_4bit_expert_reads_back_bit_for_bit(fmt):
    """Values, block scales and tensor scales of the expert slot p holds equal the checkpoint's
    expert phy2log[p], every bit."""
    config, _, params, moved, phy2log = placed("tiny", "expert_sharded", fmt, 1)
    before = jax.tree.map(np.asarray, params["layers"][1]["moe"]["experts"])
    after = jax.tree.map(np.asarray, moved["layers"][1]["moe"]["experts"])
    leaves = jax.tree.leaves(after)
    assert any(a.dtype == np.uint8 for a in leaves)  # packed 4-bit values are among the leaves moved
    for b, a in zip(jax.tree.leaves(before), leaves):
        np.testing.assert_array_equal(a.view(np.uint8), b[np.arange(len(phy2log))[:, None], phy2log].view(np.uint8))


def test_checkpoint_order_in_slots_is_bit_identical():
    """The identity placement through the slot tables computes the same logits, to the bit."""
    layout = LayoutConfig(devices=8, placement="expert_sharded")
    config = config_for("tiny", layout)
    placement = make_placement(config)
    params = load("tiny", config, placement)
    order = eplb.contiguous(moe_layers(config.model), placement.num_logical)
    slotted, moved = moves.arrange(placement, params, order, order)
    assert moved == 0
    plain = Engine(config, params, placement).generate(PROMPTS, NEW, return_logits=True)
    via = Engine(config, slotted, placement, phy2log=order).generate(PROMPTS, NEW, return_logits=True)
    np.testing.assert_array_equal(via.logits, plain.logits)


def test_tensor_sliced_refuses_expert_placement():
    with pytest.raises(ConfigError, match="tensor_sliced holds every expert"):
        make_placement(config_for("tiny", LayoutConfig(devices=8, placement="tensor_sliced", redundant_experts=8)))


def test_redundant_experts_must_split_over_ep():
    with pytest.raises(ConfigError, match="multiple of ep"):
        make_placement(config_for("tiny", LayoutConfig(devices=8, placement="expert_sharded", redundant_experts=4)))


def test_picks_of_a_replicated_expert_alternate_over_its_replicas():
    table = {k: jnp.asarray(v[0]) for k, v in slots.tables(np.array([[0, 1, 2, 3, 0, 0]]), 4).items()}
    ids = jnp.asarray([[0, 1], [0, 2], [0, 3], [3, 0]])
    assert slots.pick_slots(ids, table).tolist() == [[0, 1], [4, 2], [5, 3], [3, 0]]


def test_a_row_prefers_a_replica_on_its_own_device():
    # Slots 0..2 on device 0, 3..5 on device 1; expert 0 in slots 0 and 4.
    table = {k: jnp.asarray(v[0]) for k, v in slots.tables(np.array([[0, 1, 2, 3, 0, 4]]), 5).items()}
    ids = jnp.asarray([[0, 1], [0, 2], [0, 3], [0, 4]])  # rows 0-1 on device 0, rows 2-3 on device 1
    assert slots.pick_slots(ids, table, devices=2, home=True)[:, 0].tolist() == [0, 0, 4, 4]


@pytest.mark.parametrize("home", [False, True])
def test_host_count_routes_picks_as_the_run_does(home):
    """The host's replica choice (device rows, /metrics) is the jitted one's."""
    rng = np.random.default_rng(0)
    phy2log = random_phy2log(1, 16, 24, seed=1)
    table = slots.tables(phy2log, 16)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(32)])
    want = slots.pick_slots(jnp.asarray(ids), {k: jnp.asarray(v[0]) for k, v in table.items()}, 8, home)
    np.testing.assert_array_equal(slots.host_pick_slots(ids, {k: v[0] for k, v in table.items()}, 8, home), want)
