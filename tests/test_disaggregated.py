"""Prefill and decode on their own placements: the single-device greedy tokens whatever the
pair, and a hand-over that moves exactly the KV cache bytes whose device changes."""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import Config, LayoutConfig, preset
from moejax.engine.disaggregated import Disaggregated, bytes_moved
from moejax.engine.engine import Engine, Prefilled
from moejax.engine.kv_cache import init_cache
from moejax.launch.factory import pd_engine
from moejax.launch.loading import load_params
from sharding import make_placement, names

# As tests/test_placements.py's runs: a full run compiles the single-device and shared-device programs once.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
NEW = 5
# Each placement prefills once and decodes once: every placement into the next one.
CYCLE = [(names()[i], names()[(i + 1) % len(names())]) for i in range(len(names()))]


@functools.cache
def engine(name: str, first: int, count: int) -> Engine:
    """Placement `name` on devices first .. first + count - 1 (one device: the reference)."""
    config = Config(model=preset("tiny"), layout=LayoutConfig(placement=name, devices=count)).validate()
    placement = make_placement(config, devices=jax.devices()[first : first + count] if count > 1 else None)
    return Engine(config, load_params(config, placement, seed=1), placement)


@functools.cache
def single_device_tokens():
    return engine(names()[0], 0, 1).generate(PROMPTS, NEW).tokens


@functools.cache
def pair(prefill: str, decode: str, split: bool):
    """4 + 4 devices when split, else both on all 8."""
    devices = (0, 4) if split else (0, 8)
    return Disaggregated(engine(prefill, 0, devices[1]), engine(decode, devices[1] * split, devices[1])).generate(
        PROMPTS, NEW
    )


@pytest.mark.parametrize("prefill,decode", CYCLE)
def test_split_prefill_and_decode_give_the_single_device_tokens(prefill, decode):
    assert pair(prefill, decode, True).tokens == single_device_tokens()


def test_shared_devices_under_two_placements_give_the_single_device_tokens():
    assert pair("ragged_a2a", "weight_prefetch", False).tokens == single_device_tokens()


def cache_nbytes(batch: int, positions: int) -> int:
    shapes = jax.tree.leaves(jax.eval_shape(lambda: init_cache(preset("tiny"), batch, positions, np.float32)))
    return sum(a.size * a.dtype.itemsize for a in shapes)


def test_hand_over_between_disjoint_meshes_moves_the_written_cache():
    """4 requests (DP on 4 devices), prompts padded to 16 positions, a 16-position cache (7 + 5 bucketed)."""
    assert pair(*CYCLE[0], True).handover_bytes == cache_nbytes(4, 16) > 0


def test_hand_over_moves_only_the_positions_the_prefill_wrote():
    """A 64-position cache of which the prefill wrote 16: a quarter travels, the rest is made
    as zeros on the decode mesh."""
    prefill, decode = engine(CYCLE[0][0], 0, 4), engine(CYCLE[0][1], 4, 4)
    filled = jax.tree.map(
        lambda a: np.arange(a.size, dtype=np.float32).reshape(a.shape) % 7 + 1,
        init_cache(preset("tiny"), 4, 64, np.float32),
    )
    cache = jax.device_put(filled, prefill.placement.cache_shardings(filled))
    state = Prefilled(
        PROMPTS,
        cache,
        tok=jnp.zeros(4, jnp.int32),
        logits=None,
        lens=np.ones(4, np.int32),
        max_len=64,
        written=16,
        seeds=np.zeros(4, np.int32),
        dealer=None,
        picks=[],
        prefill_ms=0.0,
    )
    moved_state, moved, _ = Disaggregated(prefill, decode).hand_over(state)
    assert moved == cache_nbytes(4, 16)
    for run, got in zip(filled, moved_state.cache):
        for k, a in got.items():
            assert set(a.sharding.device_set) == set(jax.devices()[4:8])
            np.testing.assert_array_equal(np.asarray(a)[:, :, :16], run[k][:, :, :16])
            assert not np.asarray(a)[:, :, 16:].any()


def test_hand_over_between_layouts_of_the_same_cache_sharding_moves_nothing():
    assert pair("ragged_a2a", "weight_prefetch", False).handover_bytes == 0


def test_bytes_moved_counts_only_shards_that_change_device():
    """8 rows on devices 0-3 (2 each) laid out on devices 0, 1, 4, 5: rows 0-3 stay where they are."""
    devices = jax.devices()
    mesh = lambda ids: jax.sharding.Mesh(np.array([devices[i] for i in ids]), ("x",))
    rows = jax.device_put(np.zeros((8, 3), np.float32), NamedSharding(mesh([0, 1, 2, 3]), P("x")))
    assert bytes_moved(rows, NamedSharding(mesh([0, 1, 4, 5]), P("x"))) == 4 * 3 * 4
    assert bytes_moved(rows, NamedSharding(mesh([4, 5, 6, 7]), P(None))) == 4 * 8 * 3 * 4  # a whole copy on each


def test_two_placements_of_one_mesh_shape_on_the_same_devices_share_their_parameters():
    """Placed once per mesh: ragged_a2a and weight_prefetch are both 8 x 1 on the same devices;
    tensor_sliced (1 x 8) lays them out otherwise and places its own."""
    args = argparse.Namespace(hf=None, seed=0, checkpoint=None)
    config = Config(model=preset("tiny"), layout=LayoutConfig(devices=8)).validate()
    ragged = pd_engine(config, jax.devices(), "ragged_a2a", args)
    assert pd_engine(config, jax.devices(), "weight_prefetch", args, others=[ragged]).params is ragged.params
    assert pd_engine(config, jax.devices(), "tensor_sliced", args, others=[ragged]).params is not ragged.params
