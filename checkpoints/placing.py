"""A parameter as read (a float array, or 4-bit experts as published) in the form a run
computes with, and onto a placement, one layer at a time.

Float expert matrices are quantized when the run asks for 4-bit experts
(`pallas_kernels.run_weights`, in the placement's K-slices). 4-bit experts read as published
(`PackedExperts`) are repacked from the file's adjacent pairs into the in-memory packing of each
K-slice (`packing.from_disk`), bit for bit: no requantization. Everything else (expert biases
included) is cast to the run dtype.

At full size a run's stacked tensor (DeepSeek-V3's gate projections of 58 layers: 435 GB in
bf16) fits neither the host nor one device, so loading goes layer by layer: a layer's tensor is
read, brought to its run form on the host (4-bit work runs on a CPU device a few experts at a
time and comes back as numpy), each device takes its own block of it (`Placement.place`), and
the block is written into that device's share of the run's stack in place (a donated
`dynamic_update_index_in_dim`), or, for a run its loop holds unrolled (`layer_loop.Unrolled`),
kept as that layer's own arrays, an expert matrix a buffer per expert where the kernel
multiplies each where it lies (`Placement.place_groups`): never a stack to be split at start-up.
The host then holds about one layer's tensor and a device never more than its own share of a
parameter plus one layer of it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels
from checkpoints import packing
from checkpoints.quantization import PackedExperts
from moejax.base.errors import UsageError
from moejax.base.platform import host_device
from moejax.model.params import ParamSpec, expert_axis, is_expert_matrix, param_dtype
from moejax.vocab import QUANTIZED_FORMATS

# Float32 bytes of the experts quantized in one go on the host: bounds the CPU device's
# temporaries whatever the expert size (an expert of GLM-5.3 is 6144 x 2048: 50 MB).
HOST_CHUNK_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Layers:
    """A run's parameter as one read per layer (files hold each layer's tensor apart)."""

    reads: tuple[Callable[[], object], ...]


def run_form(spec: ParamSpec, array, dtype, expert_format: str, k_slices: int = 1, kernel: str = "auto"):
    """One parameter as a run of `expert_format` experts computes with it."""
    if isinstance(array, PackedExperts):
        if expert_format != array.fmt:
            raise UsageError(f"the checkpoint's experts are {array.fmt}; they run as {array.fmt} (not {expert_format})")
        values = packing.from_disk(jax.numpy.asarray(array.values), k_slices)
        q = pallas_kernels.QuantizedArray(
            values,
            jax.numpy.asarray(array.scales),
            None if array.tensor_scale is None else jax.numpy.asarray(array.tensor_scale),
            fmt=array.fmt,
            axis=-2,
        )
        return pallas_kernels.for_kernel(q, kernel)
    array = array.astype(param_dtype(spec, dtype))
    if is_expert_matrix(spec):
        return pallas_kernels.run_weights(array, expert_format, k_slices, kernel, gated=spec.gated)
    return array


def host_form(spec: ParamSpec, array, dtype, expert_format: str, k_slices: int = 1, kernel: str = "auto"):
    """`run_form` as numpy, computed without an accelerator: 4-bit experts (quantized or
    repacked) on a CPU device, `HOST_CHUNK_BYTES` of experts at a time; the result is the same
    as one call on the whole stack, since each expert is quantized on its own."""
    if not (is_expert_matrix(spec) and (isinstance(array, PackedExperts) or expert_format in QUANTIZED_FORMATS)):
        return np.asarray(array).astype(param_dtype(spec, dtype), copy=False)
    ax = expert_axis(spec)
    e, (k, n) = array.shape[ax], array.shape[-2:]
    per_chunk = max(1, HOST_CHUNK_BYTES // (4 * k * n * int(np.prod(array.shape[:ax], dtype=np.int64))))
    take = lambda a, s: None if a is None else a[(slice(None),) * ax + (slice(s, s + per_chunk),)]
    parts = []
    with jax.default_device(host_device()):
        for s in range(0, e, per_chunk):
            part = (
                PackedExperts(take(array.values, s), take(array.scales, s), take(array.tensor_scale, s), array.fmt)
                if isinstance(array, PackedExperts)
                else take(array, s)
            )
            parts.append(jax.device_get(run_form(spec, part, dtype, expert_format, k_slices, kernel)))
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=ax), *parts)


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4, 5))
def device_form(spec: ParamSpec, array, dtype, expert_format: str, k_slices: int = 1, kernel: str = "auto"):
    """`run_form` in one program on the device holding `array` (random weights drawn there)."""
    return run_form(spec, array, dtype, expert_format, k_slices, kernel)


def _unstacked(spec: ParamSpec) -> ParamSpec:
    return dataclasses.replace(spec, shape=spec.shape[1:], axes=spec.axes[1:])


def _stacked_sharding(layer: jax.Array, count: int):
    """The sharding of `count` layers like `layer` stacked on a new, never-sharded, first axis."""
    s = layer.sharding
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
    return s


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(whole, layer, i):
    return jax.tree.map(lambda w, x: jax.lax.dynamic_update_index_in_dim(w, x, i, 0), whole, layer)


def _empty_stack(layer, count: int):
    """Zeros for `count` layers shaped and sharded like `layer` (a tree), made on their devices."""
    return jax.tree.map(
        lambda a: jax.numpy.zeros((count, *a.shape), a.dtype, device=_stacked_sharding(a, count)), layer
    )


def layer_forms(spec: ParamSpec, source, form: Callable):
    """Yields (layer, count, `form(layer_spec, array)`) for each layer of a run's stacked
    parameter, reading one layer at a time. `source`: `Layers`, or the whole stacked array."""
    layer_spec = _unstacked(spec)
    reads: Sequence = (
        source.reads
        if isinstance(source, Layers)
        else [functools.partial(operator.getitem, source, i) for i in range(spec.shape[0])]
    )
    for i, read in enumerate(reads):
        yield i, len(reads), form(layer_spec, read())


def is_stacked(spec: ParamSpec) -> bool:
    return spec.axes[:1] == ("layers",)


def place_tensor(placement, spec: ParamSpec, source, dtype, held: str = "stack", on_device: bool = False):
    """One parameter on its devices, in the run's form. `source`: the array (host or device,
    or `PackedExperts`); for a run's stacked spec also `Layers`, read one layer at a time, and
    `held` as the run's loop holds it (`layer_loop`): one "stack" [layers, ...], or a tuple of
    each layer's own arrays ("layers"), or of each layer's experts a buffer each ("groups").
    `on_device`: the source's arrays lie on a device, which brings them to their run form too
    (`device_form`), else the host does (`host_form`)."""
    config = placement.config
    to_form = device_form if on_device else host_form
    form = lambda s, a: to_form(s, a, dtype, config.weights.expert_format, placement.k_slices(spec), config.kernel)
    if not is_stacked(spec):
        return placement.place(spec, form(spec, source))
    layer_spec = _unstacked(spec)
    put = functools.partial(placement.place_groups if held == "groups" else placement.place, layer_spec)
    if held != "stack":
        return tuple(put(host) for _, _, host in layer_forms(spec, source, form))
    whole = None
    for i, count, host in layer_forms(spec, source, form):
        layer = put(host)
        whole = _set_layer(_empty_stack(layer, count) if whole is None else whole, layer, np.int32(i))
    return whole


def host_tensor(spec: ParamSpec, source, dtype, expert_format: str):
    """One parameter in its run form (one K-slice) as numpy, a run's stack filled layer by layer."""
    form = lambda s, a: host_form(s, a, dtype, expert_format)
    if not is_stacked(spec):
        return form(spec, source)
    whole = None
    for i, count, layer in layer_forms(spec, source, form):
        if whole is None:
            whole = jax.tree.map(lambda a: np.empty((count, *a.shape), a.dtype), layer)
        jax.tree.map(lambda w, a: w.__setitem__(i, a), whole, layer)
    return whole
