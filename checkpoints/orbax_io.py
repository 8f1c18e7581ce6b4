"""Parameters to and from orbax: written group by group, restored straight into a placement.

Arrays are stored as the model defines them (unpadded expert stacks, 4-bit experts as their
`QuantizedArray` leaves, values in the placement-independent packing of `packing.py`). A group holds parameters up to
the size of the model's largest one (or `GROUP_BYTES`, whichever is larger), so a writer never holds much more than
two of
the largest tensors at once. Restoring asks orbax for each array with its target
`NamedSharding` and the placement's padded expert count: every device reads only its own
shard, and padding experts come back as zeros.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from checkpoints import legacy, packing
from checkpoints.manifest import (
    MANIFEST,
    Manifest,
    commit,
    file_sums,
    new_data_dir,
    read_manifest,
    verify_files,
    warn_leftovers,
)
from moejax.base import platform
from moejax.base.errors import UsageError
from moejax.model.params import ParamSpec, expert_axis, is_expert_matrix, is_expert_stack, param_dtype, param_specs

QUANTIZED_LEAVES = ("values", "scales", "tensor_scale")
GROUP_BYTES = 64 << 20  # below this, orbax's fixed cost per save and restore dominates


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_key(path) -> str:
    """'layers.3.moe.experts.gate' for the path ('layers', 3, 'moe', 'experts', 'gate')."""
    return ".".join(map(str, path))


def named_specs(manifest: Manifest) -> tuple[list[tuple[str, ParamSpec]], object]:
    """(parameter key, spec) in tree order, and the treedef to rebuild the parameter tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_specs(manifest.model), is_leaf=_is_spec)
    return [(param_key(getattr(k, "key", getattr(k, "idx", None)) for k in path), spec) for path, spec in flat], treedef


def is_quantized(spec: ParamSpec, expert_format: str) -> bool:
    """4-bit expert matrices; expert biases stay in the storage dtype."""
    return is_expert_matrix(spec) and expert_format in pallas_kernels.FORMATS


def stored_leaves(spec: ParamSpec, manifest: Manifest) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes one parameter is stored as."""
    if not is_quantized(spec, manifest.expert_format):
        return {"w": jax.ShapeDtypeStruct(spec.shape, param_dtype(spec, manifest.dtype))}
    try:
        q = jax.eval_shape(
            lambda w: pallas_kernels.quantize_experts(w, manifest.expert_format, gated=spec.gated),
            jax.ShapeDtypeStruct(spec.shape, jnp.float32),
        )
    except ValueError as e:  # a reduction axis the format's blocks do not divide
        raise UsageError(f"experts {list(spec.shape)} cannot be stored as {e}") from None
    return {k: getattr(q, k) for k in QUANTIZED_LEAVES if getattr(q, k) is not None}


def to_stored(spec: ParamSpec, value, k_slices: int) -> dict:
    """A parameter in its run format (4-bit experts packed in `k_slices` K-slices) as the dict of
    arrays orbax writes."""
    if isinstance(value, pallas_kernels.QuantizedArray):
        value = value.replace(values=packing.to_disk(value.values, k_slices))
        return {k: getattr(value, k) for k in QUANTIZED_LEAVES if getattr(value, k) is not None}
    return {"w": value}


def _nbytes(tree: dict) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in tree.values())


def _checkpointer():
    import absl.logging
    import orbax.checkpoint as ocp

    # orbax logs a failed read or write with tracebacks from its worker threads; the error
    # reaches us as an exception anyway, and becomes the CLI's one line.
    absl.logging.set_verbosity(absl.logging.FATAL)
    return ocp.PyTreeCheckpointer()


# ----------------------------------------------------------------------------- save


def _write_groups(data: Path, params: Iterable[tuple[str, dict]], budget: int) -> list[tuple[tuple, dict]]:
    """One orbax checkpoint per group of at most `budget` bytes: [(keys, file sums)]."""
    checkpointer = _checkpointer()
    groups, group = [], {}

    def flush():
        name = f"{len(groups):04d}"
        try:
            checkpointer.save(data / name, group)
        except Exception as e:  # noqa: BLE001 - disk full, permissions: whatever tensorstore met
            raise UsageError(f"{data / name}: cannot write ({_first_line(e)})") from None
        groups.append((tuple(group), file_sums(data, name)))  # just written: read from the page cache
        group.clear()

    for key, stored in params:
        if group and _nbytes(stored) + sum(_nbytes(t) for t in group.values()) > budget:
            flush()
        group[key] = stored
    if group:
        flush()
    return groups


def write(ckpt: str | Path, manifest: Manifest, params: Iterable[tuple[str, dict]]) -> Manifest:
    """Writes `(key, stored dict)` pairs, in tree order, as a new committed checkpoint."""
    ckpt = Path(ckpt).absolute()  # orbax takes absolute paths only
    names, _ = named_specs(manifest)
    budget = max([GROUP_BYTES] + [_nbytes(stored_leaves(spec, manifest)) for _, spec in names])
    with new_data_dir(ckpt) as (data, previous):
        groups = _write_groups(data, params, budget)
        manifest = dataclasses.replace(
            manifest,
            data=data.name,
            groups=tuple(g for g, _ in groups),
            files={k: v for _, files in groups for k, v in files.items()},
        )
    commit(ckpt, manifest, previous)  # outside: once committed, the new data must never be removed
    return manifest


def save_params(ckpt: str | Path, params: dict, placement) -> Manifest:
    """Saves the parameters of `placement` (any): padding experts are dropped on the way out."""
    config = placement.config
    manifest = Manifest(config.model, platform.run_dtype(config.engine.dtype), config.weights.expert_format)
    names, _ = named_specs(manifest)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, pallas_kernels.QuantizedArray))
    e = config.model.num_experts

    def unpadded():
        for (key, spec), value in zip(names, leaves):
            if is_expert_stack(spec):
                value = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, e, axis=expert_axis(spec)), value)
            yield key, to_stored(spec, value, placement.k_slices(spec))

    return write(ckpt, manifest, unpadded())


# ----------------------------------------------------------------------------- restore


def _check_group(directory: Path, keys: tuple[str, ...], expected: dict[str, dict]) -> None:
    """The arrays on disk are those the manifest's model config implies, by name and shape."""
    try:
        stored = _checkpointer().metadata(directory).item_metadata.tree
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged file
        raise UsageError(f"{directory}: unreadable checkpoint data ({_first_line(e)})") from None
    if not isinstance(stored, dict):
        raise UsageError(f"{directory}: unreadable checkpoint data (no array metadata)")
    for key in keys:
        if key not in expected:
            raise UsageError(f"{directory.parent.parent / MANIFEST}: lists {key}, which its model config does not have")
        have = {k: (tuple(m.shape), jnp.dtype(m.dtype)) for k, m in (stored.get(key) or {}).items()}
        want = {k: (tuple(a.shape), jnp.dtype(a.dtype)) for k, a in expected[key].items()}
        if have != want:
            raise UsageError(
                f"{directory}: {key} is stored as {_describe(have)}, but the model config "
                f"in {MANIFEST} implies {_describe(want)}"
            )


def _describe(leaves: dict) -> str:
    return ", ".join(f"{k} {list(s)} {d}" for k, (s, d) in sorted(leaves.items())) or "nothing"


def _first_line(e: BaseException) -> str:
    while e.__cause__ is not None:  # tensorstore's own words sit at the bottom of the chain
        e = e.__cause__
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _restore_args(spec: ParamSpec, leaves: dict, placement, run_dtype) -> dict:
    import orbax.checkpoint as ocp

    out = {}
    for name, leaf in leaves.items():
        shape = list(leaf.shape)
        if is_expert_stack(spec):
            shape[expert_axis(spec)] = placement.num_experts  # padding experts: orbax fills zeros
        dtype = param_dtype(spec, run_dtype) if name == "w" else leaf.dtype
        sharding = placement.sharding(spec.axes, tuple(shape)) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(shape), dtype=dtype, strict=False)
    return out


def _as_param(spec: ParamSpec, arrays: dict, expert_format: str, placement):
    if not is_quantized(spec, expert_format):
        return arrays["w"]
    v = arrays["values"]
    values = packing.from_disk(v, placement.k_slices(spec), v.sharding)
    return pallas_kernels.QuantizedArray(
        values, arrays["scales"], arrays.get("tensor_scale"), fmt=expert_format, axis=-2
    )


def restore_params(ckpt: str | Path, config, placement) -> dict:
    """Parameters of `placement`, each array read directly into its target sharding."""
    import orbax.checkpoint as ocp

    ckpt = Path(ckpt).absolute()
    manifest = read_manifest(ckpt)
    warn_leftovers(ckpt, manifest.data)
    names, treedef = named_specs(manifest)
    if manifest.version == 2:  # gate and up stored apart: read as such, fused below
        names, model_names = legacy.stored_names(names), names
    specs = dict(names)
    expected = {key: stored_leaves(spec, manifest) for key, spec in names}
    missing = [k for k in specs if k not in {k for g in manifest.groups for k in g}]
    if missing:
        raise UsageError(f"{ckpt / MANIFEST}: no stored array for {missing[0]}")
    restored: dict[str, object] = {}
    checkpointer = _checkpointer()
    for i, keys in enumerate(manifest.groups):
        directory = ckpt / manifest.data / f"{i:04d}"
        verify_files(ckpt, manifest, directory.name)
        _check_group(directory, keys, expected)
        args = {
            k: _restore_args(specs[k], expected[k], placement, platform.run_dtype(config.engine.dtype)) for k in keys
        }
        try:
            arrays = checkpointer.restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))
        except Exception as e:  # noqa: BLE001 - truncated/corrupted data surfaces as assorted errors
            raise UsageError(f"{directory}: unreadable checkpoint data ({_first_line(e)})") from None
        restored.update({k: _as_param(specs[k], arrays[k], manifest.expert_format, placement) for k in keys})
    if manifest.version == 2:
        restored, names = legacy.fused(restored, model_names, placement), model_names
    return jax.tree.unflatten(treedef, [restored[k] for k, _ in names])
