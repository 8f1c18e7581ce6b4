"""Model loading: a preset with random weights, a transformers directory or a moejax checkpoint,
onto a placement."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from checkpoints.hf import expert_format, has_mtp, load_hf, read_hf_config
from checkpoints.manifest import read_manifest
from checkpoints.orbax_io import restore_params
from checkpoints.placing import Layers, place_tensor
from moejax.base.errors import UsageError
from moejax.base.platform import host_device, run_dtype
from moejax.config import Config
from moejax.model import layer_loop
from moejax.model.mtp import mtp_specs
from moejax.model.params import ParamSpec, init_param, param_keys, param_specs


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
        raise UsageError(
            f"{checkpoint} holds {manifest.expert_format} experts, not {wanted}; "
            f"convert with --expert-format {wanted} for that"
        )
    return dataclasses.replace(
        config, model=manifest.model, weights=dataclasses.replace(config.weights, expert_format=manifest.expert_format)
    )


def random_params(
    config: Config, placement, seed: int, specs: dict, loops: tuple | None = None, on_device: bool | None = None
) -> dict:
    """Random parameters (`init_param`) placed as a checkpoint's would be, one layer at a time, so
    no device holds more than its own share plus a layer; each run of layers held by its loop of
    `loops` (default: stacked). Drawn (and 4-bit experts quantized) on the first device where
    `on_device` (default: on an accelerator, one process: `Platform.forms_on_device`), else on the
    host's CPU device; the same values either way (threefry's bits do not depend on the device)."""
    c, dtype = config.model, jnp.dtype(run_dtype(config.engine.dtype))
    if on_device is None:
        on_device = placement.platform.forms_on_device and jax.process_count() == 1
    key = jax.device_put(jax.random.key(seed), jax.devices()[0] if on_device else host_device())
    runs = loops or layer_loop.stacked(c)

    def place(path, spec: ParamSpec, k):
        if spec.axes[:1] == ("layers",):
            source = Layers(tuple(functools.partial(init_param, spec, k, c, dtype, i) for i in range(spec.shape[0])))
        else:
            source = init_param(spec, k, c, dtype)
        keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
        return place_tensor(placement, spec, source, dtype, layer_loop.holds(runs, keys), on_device)

    params = jax.tree_util.tree_map_with_path(
        place, specs, param_keys(specs, key), is_leaf=lambda x: isinstance(x, ParamSpec)
    )
    return layer_loop.assemble(params, runs)


def load_params(
    config: Config,
    placement,
    *,
    hf_dir: str | None = None,
    checkpoint: str | None = None,
    seed: int = 0,
    loops: tuple | None = None,
) -> dict:
    """Parameters placed by `placement`: read from `hf_dir`, restored from `checkpoint` (each
    array straight into its sharding), or random from `seed`. Each run of layers is held as its
    loop of `loops` holds it (`layer_loop`; default: every run stacked, as at rest): an engine's
    loops (`placement.loops`) take an unrolled run's layers, and its expert groups, straight into
    their own buffers rather than through a stack."""
    loops = loops or layer_loop.stacked(config.model)
    if hf_dir is not None:
        return load_hf(hf_dir, config.model, jnp.dtype(run_dtype(config.engine.dtype)), placement, loops=loops)
    if checkpoint is not None:
        return layer_loop.arrange(restore_params(checkpoint, config, placement), loops)
    return random_params(config, placement, seed, param_specs(config.model), loops)


def load_mtp(
    config: Config,
    placement,
    *,
    hf_dir: str | None = None,
    checkpoint: str | None = None,
    init: str | None = None,
    seed: int = 0,
) -> dict:
    """The MTP module's parameters, placed: read from a transformers-layout directory that
    carries them; random when `init == "random"` or the model itself is random (a preset)."""
    c, dtype = config.model, jnp.dtype(run_dtype(config.engine.dtype))
    if hf_dir is not None and has_mtp(hf_dir, c):
        return load_hf(hf_dir, c, dtype, placement, mtp=True)
    source = hf_dir or checkpoint
    if source is not None and init != "random":
        raise UsageError(
            f"--speculative mtp: {source} has no MTP weights (model.layers.{c.num_layers}.eh_proj and the "
            "rest of that layer; transformers drops them); pass --mtp-init random for a random draft module"
        )
    return random_params(config, placement, seed + 1, mtp_specs(c))
