"""Model loading: a preset with random weights, or a transformers directory, onto a placement."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints.hf import load_hf, read_hf_config
from moejax.config import Config
from moejax.model.params import ParamSpec, init_params, param_specs


def with_hf_model(config: Config, hf_dir: str | None) -> Config:
    """The run config with the model described by `hf_dir/config.json` (unchanged without one)."""
    return config if hf_dir is None else dataclasses.replace(config, model=read_hf_config(hf_dir))


def load_params(config: Config, placement, *, hf_dir: str | None = None, seed: int = 0) -> dict:
    """Parameters placed by `placement`: read from `hf_dir`, or random from `seed`."""
    dtype = jnp.dtype(config.engine.dtype)
    if hf_dir is not None:
        return load_hf(hf_dir, config.model, dtype, placement.place)
    specs = jax.tree.leaves(param_specs(config.model), is_leaf=lambda x: isinstance(x, ParamSpec))
    flat, treedef = jax.tree_util.tree_flatten_with_path(init_params(config.model, jax.random.key(seed), dtype))
    return jax.tree.unflatten(treedef, [placement.place(spec, x) for (_, x), spec in zip(flat, specs)])
