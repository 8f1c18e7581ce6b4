"""Loading at scale: parameters go to their devices one layer at a time, each device taking only
its own share; 4-bit experts are quantized a layer at a time (on the host, or on an accelerator's
first device), never whole on one device."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moejax.config import Config, EngineConfig, LayoutConfig, WeightsConfig, preset
from moejax.launch.loading import load_params, random_params
from moejax.model.layer_loop import arrange
from moejax.model.params import init_params, param_specs
from sharding import make_placement, names
from sharding.mesh import MeshPlacement
from sharding.tensor_sliced import TensorSliced

# Experts dominate, as at full size: a whole expert stack on one device is many shares.
MODEL = dataclasses.replace(preset("tiny"), num_experts=32, moe_intermediate_size=256)


def config(placement: str, fmt: str) -> Config:
    return Config(
        model=MODEL,
        layout=LayoutConfig(devices=8, placement=placement),
        weights=WeightsConfig(fmt),
        engine=EngineConfig(dtype="bfloat16"),
    ).validate()


def shard_bytes(arrays) -> list[int]:
    return [s.data.nbytes for a in arrays for s in a.addressable_shards]


@pytest.mark.parametrize("fmt", ["unquantized", "nvfp4"])
@pytest.mark.parametrize("name", names())
def test_loading_never_holds_more_than_a_share_on_a_device(name, fmt, monkeypatch):
    """At every put, each device buffer that loading made is at most the largest per-device share
    of a parameter (the old loader held a run's whole quantized stack on the default device)."""
    cfg = config(name, fmt)
    placement = make_placement(cfg)
    before = jax.live_arrays()  # held, so their ids stay theirs
    old = {id(a) for a in before}
    seen = []
    put = MeshPlacement.put

    def watched(self, array, axes):
        seen.extend(shard_bytes(a for a in jax.live_arrays() if id(a) not in old))
        return put(self, array, axes)

    monkeypatch.setattr(MeshPlacement, "put", watched)
    params = load_params(cfg, placement)
    share = max(shard_bytes(jax.tree.leaves(params)))
    experts = params["layers"][-1]["moe"]["experts"]["gate_up"]
    whole_stack = sum(leaf.nbytes for leaf in jax.tree.leaves(experts))
    assert whole_stack >= 4 * share  # the model is one where a whole stack on a device would show
    assert seen and max(seen) <= share


@pytest.mark.parametrize("fmt", ["unquantized", "nvfp4"])
@pytest.mark.parametrize("name", ["expert_sharded", TensorSliced.name])  # experts split by expert, by K-slice
def test_weights_drawn_on_the_device_are_the_hosts(name, fmt):
    """An accelerator draws random weights and quantizes 4-bit experts on its first device
    (`Platform.forms_on_device`): the values and shardings the host's CPU device makes."""
    cfg = config(name, fmt)
    placement = make_placement(cfg)
    host, device = (random_params(cfg, placement, 3, param_specs(MODEL), on_device=where) for where in (False, True))
    assert jax.tree.structure(device) == jax.tree.structure(host)
    for d, h in zip(jax.tree.leaves(device), jax.tree.leaves(host)):
        assert d.sharding.is_equivalent_to(h.sharding, d.ndim)
        np.testing.assert_array_equal(np.asarray(d), np.asarray(h))


def test_a_layer_drawn_alone_is_that_layer_of_the_whole():
    """Random parameters are placed layer by layer; drawing them whole gives the same values."""
    cfg = config("expert_sharded", "unquantized")
    placed = load_params(cfg, make_placement(cfg), seed=3)
    whole = init_params(MODEL, jax.random.key(3), "bfloat16")
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(whole)):
        got = np.asarray(got)
        np.testing.assert_array_equal(got[tuple(slice(0, n) for n in want.shape)], np.asarray(want))


@pytest.mark.parametrize("fmt", ["unquantized", "nvfp4"])
def test_an_unrolled_run_loads_straight_into_its_layers_and_expert_groups(fmt, monkeypatch):
    """Loaded with a placement's loops, an unrolled run holds what the engine's arrangement of the
    stack holds (each layer's own arrays, each expert group its own buffer: same values, same
    shardings), and no stack is made on the way: at every put, no device buffer loading made is
    larger than the largest the engine keeps."""
    cfg = dataclasses.replace(
        config(TensorSliced.name, fmt),
        layout=LayoutConfig(devices=2, placement=TensorSliced.name),
        engine=EngineConfig(dtype="bfloat16", layer_loop="unroll"),
    ).validate()
    placement = make_placement(cfg)
    assert all(loop.groups for loop in placement.loops)
    want = arrange(load_params(cfg, placement, seed=3), placement.loops)
    old = {id(a) for a in jax.live_arrays()}
    seen, put = [], MeshPlacement.put

    def watched(self, array, axes):
        seen.extend(shard_bytes(a for a in jax.live_arrays() if id(a) not in old))
        return put(self, array, axes)

    monkeypatch.setattr(MeshPlacement, "put", watched)
    got = load_params(cfg, placement, seed=3, loops=placement.loops)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert seen and max(seen) <= max(shard_bytes(jax.tree.leaves(got)))
