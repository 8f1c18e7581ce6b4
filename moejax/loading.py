"""Model loading: a preset with random weights, a transformers directory or a moejax checkpoint,
onto a placement."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from checkpoints.hf import expert_format, has_mtp, load_hf, read_hf_config
from checkpoints.manifest import read_manifest
from checkpoints.orbax_io import restore_params
from checkpoints.placing import place_tensor
from moejax.config import Config
from moejax.errors import UsageError
from moejax.model.mtp import mtp_specs
from moejax.model.params import ParamSpec, init_params, param_specs


def with_hf_model(config: Config, hf_dir: str | None, checkpoint: str | None = None) -> Config:
    """The run config with the model of `hf_dir/config.json` or of `checkpoint` (unchanged
    without either). Experts stored 4-bit (a moejax checkpoint, or a published NVFP4/MXFP4
    directory) are used in the format they were stored in."""
    if hf_dir is not None:
        weights = dataclasses.replace(config.weights, expert_format=expert_format(hf_dir, config.weights.expert_format))
        return dataclasses.replace(config, model=read_hf_config(hf_dir), weights=weights)
    if checkpoint is None:
        return config
    manifest = read_manifest(checkpoint)
    wanted = config.weights.expert_format
    if wanted not in ("unquantized", manifest.expert_format):
        raise UsageError(f"{checkpoint} holds {manifest.expert_format} experts, not {wanted}; "
                         f"convert with --expert-format {wanted} for that")
    return dataclasses.replace(config, model=manifest.model,
                               weights=dataclasses.replace(config.weights, expert_format=manifest.expert_format))


def load_params(config: Config, placement, *, hf_dir: str | None = None, checkpoint: str | None = None,
                seed: int = 0) -> dict:
    """Parameters placed by `placement`: read from `hf_dir`, restored from `checkpoint` (each
    array straight into its sharding), or random from `seed`."""
    dtype = jnp.dtype(config.engine.dtype)
    if hf_dir is not None:
        return load_hf(hf_dir, config.model, dtype, placement)
    if checkpoint is not None:
        return restore_params(checkpoint, config, placement)
    specs = jax.tree.leaves(param_specs(config.model), is_leaf=lambda x: isinstance(x, ParamSpec))
    flat, treedef = jax.tree_util.tree_flatten_with_path(init_params(config.model, jax.random.key(seed), dtype))
    return jax.tree.unflatten(treedef, [place_tensor(placement, spec, x, dtype) for (_, x), spec in zip(flat, specs)])


def load_mtp(config: Config, placement, *, hf_dir: str | None = None, checkpoint: str | None = None,
             init: str | None = None, seed: int = 0) -> dict:
    """The MTP module's parameters, placed: read from a transformers-layout directory that
    carries them; random when `init == "random"` or the model itself is random (a preset)."""
    c, dtype = config.model, jnp.dtype(config.engine.dtype)
    if hf_dir is not None and has_mtp(hf_dir, c):
        return load_hf(hf_dir, c, dtype, placement, mtp=True)
    source = hf_dir or checkpoint
    if source is not None and init != "random":
        raise UsageError(f"--speculative mtp: {source} has no MTP weights (model.layers.{c.num_layers}.eh_proj and the "
                         "rest of that layer; transformers drops them); pass --mtp-init random for a random draft module")
    specs = mtp_specs(c)
    params = init_params(c, jax.random.key(seed + 1), dtype, specs=specs)
    return jax.tree.map(lambda spec, a: place_tensor(placement, spec, a, dtype), specs, params,
                        is_leaf=lambda x: isinstance(x, ParamSpec))
