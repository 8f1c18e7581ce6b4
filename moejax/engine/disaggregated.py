"""Prefill and decode on their own placements and meshes (Row-Meets-Experts §6.6): one engine
prefills, its KV cache is handed to the other engine's layout, and that engine decodes.

Each engine holds its own parameters, placed once on its mesh. The meshes may share devices
(two layouts of the same devices) or split them. The hand-over moves only the cache positions
the prefill wrote (the rest of a cache is zeros, made on the decode side): a `jax.device_put`
of each array's written positions onto the decode placement's cache sharding, which moves only
the shards whose device changes (`bytes_moved` counts them). With MTP speculative decoding the
MTP layer's cache goes the same way, and the speculative state (tokens, drafts, key) with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.engine import compile_clock
from moejax.engine.engine import Engine, Generation, Prefilled
from moejax.engine.host import to_host
from moejax.engine.sampling import Sampling
from moejax.engine.speculative import SpecGeneration, SpecPrefilled, SpecState, SpeculativeEngine


def _overlap(a: tuple, b: tuple, shape: tuple) -> int:
    """Elements two index tuples (of slices, from `devices_indices_map`) have in common."""
    n = 1
    for sa, sb, size in zip(a, b, shape):
        (a0, a1, _), (b0, b1, _) = sa.indices(size), sb.indices(size)
        n *= max(0, min(a1, b1) - max(a0, b0))
    return n


def bytes_moved(array: jax.Array, target: jax.sharding.Sharding) -> int:
    """Bytes of `array` that change device when it is laid out as `target`: each target shard,
    less what of it the device already holds."""
    shape = array.shape
    have = array.sharding.devices_indices_map(shape)
    elements = sum(
        _overlap(index, index, shape) - (_overlap(index, have[d], shape) if d in have else 0)
        for d, index in target.devices_indices_map(shape).items()
    )
    return elements * array.dtype.itemsize


def _positions(a: jax.Array, axes: tuple, n: int) -> jax.Array:
    """a's first n cache positions (its "cache_seq" axis)."""
    return jax.lax.slice_in_dim(a, 0, n, axis=axes.index("cache_seq"))


@functools.partial(jax.jit, static_argnames=("axis", "length", "sharding"))
def _zero_tail_jit(a, *, axis: int, length: int, sharding):
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, length - a.shape[axis])
    return jax.lax.with_sharding_constraint(jnp.pad(a, pad), sharding)


def _zero_tail(a: jax.Array, axes: tuple, length: int, sharding) -> jax.Array:
    """a, zero-padded along its cache positions to `length`, where it lies (on the decode mesh)."""
    return _zero_tail_jit(a, axis=axes.index("cache_seq"), length=length, sharding=sharding)


def _paired(source: list, target: np.ndarray) -> np.ndarray:
    """The `source` devices laid out as the `target` mesh's array, each in its target device's process."""
    pools = {}
    for d in source:
        pools.setdefault(d.process_index, []).append(d)
    return np.array([pools[t.process_index].pop(0) for t in target.flat]).reshape(target.shape)


@functools.cache
def _permute(both: Mesh, spec: P):
    """Side 0's shards of a [2, ...] array to side 1's devices, one collective permute."""
    return jax.jit(
        jax.shard_map(lambda a: jax.lax.ppermute(a, "side", [(0, 1)]), mesh=both, in_specs=spec, out_specs=spec)
    )


def _across_processes(x: jax.Array, target: NamedSharding, source: list) -> jax.Array:
    """x onto `target`, the two device sets disjoint and spanning several processes. JAX's
    device_put refuses that: jax 0.10.2's `_device_put_sharding_impl` copies between two device
    sets of several processes only when both shardings are equal and the sets lie in different
    processes, by the runtime's cross-host transfers (none on XLA:CPU; elsewhere a DCN socket
    server, `jax_cross_host_transfer_socket_address`); here every process holds devices of both.
    So one program over both sets moves it: x laid out as `target` on its own devices, each
    beside a target device of its process (a reshard within the source devices, nothing when the
    layouts agree), then stacked with zeros on the target devices as a [2, ...] array over a
    ("side", ...) mesh of both, and side 0's shards permuted to side 1."""
    paired = Mesh(_paired(source, target.mesh.devices), target.mesh.axis_names, axis_types=target.mesh.axis_types)
    x = jax.device_put(x, NamedSharding(paired, target.spec))
    both = Mesh(np.stack([paired.devices, target.mesh.devices]), ("side", *target.mesh.axis_names))
    spec = P("side", *target.spec)
    here = [d for d in target.mesh.devices.flat if d.process_index == jax.process_index()]
    zeros = [jax.device_put(np.zeros((1, *target.shard_shape(x.shape)), x.dtype), d) for d in here]
    stacked = jax.make_array_from_single_device_arrays(
        (2, *x.shape), NamedSharding(both, spec), [s.data[None] for s in x.addressable_shards] + zeros
    )
    moved = _permute(both, spec)(stacked)
    return jax.make_array_from_single_device_arrays(
        x.shape, target, [s.data[0] for s in moved.addressable_shards if s.device in set(here)]
    )


def onto(x: jax.Array, target: NamedSharding, source: list) -> jax.Array:
    """x, on the `source` devices, laid out as `target` (a sharding of the same or other devices)."""
    if jax.process_count() == 1 or set(source) == target.device_set:
        return jax.device_put(x, target)  # moves only the shards whose device changes
    return _across_processes(x, target, source)


def move_cache(runs: list[dict], placement, source: list, pool: bool = False) -> tuple[list[dict], int]:
    """Cache runs (arrays on the `source` devices; `pool`: pages of a pool) laid out as
    `placement` keeps a cache of their shape -> (runs there, bytes that changed device)."""
    targets = placement.cache_shardings(runs, pool)
    moved = sum(bytes_moved(a, run_t[k]) for run, run_t in zip(runs, targets) for k, a in run.items())
    return [{k: onto(v, run_t[k], source) for k, v in run.items()} for run, run_t in zip(runs, targets)], moved


def _via_host(x: jax.Array, axes: tuple, placement) -> jax.Array:
    """A small array (tokens, positions, seeds) through the host onto `placement`."""
    return placement.put(to_host(x), axes)


# Logical axes of the speculative state's arrays on the decode mesh.
SPEC_STATE_AXES = SpecState(
    token=("batch",), draft=("batch",), draft_probs=("batch", None), pos=("batch",), count=("batch",), seeds=("batch",)
)


class Disaggregated:
    """`prefill` prefills, `decode` decodes: two engines of one model on their own placements
    (two `Engine`s, or two `SpeculativeEngine`s, each with its MTP module)."""

    def __init__(self, prefill: Engine | SpeculativeEngine, decode: Engine | SpeculativeEngine):
        self.prefill, self.decode = prefill, decode

    def _move_cache(self, runs: list[dict], written: int, max_len: int) -> tuple[list[dict], int]:
        """Cache runs' first `written` positions onto the decode placement, zero-padded there to
        max_len -> (runs there, bytes that changed device)."""
        decode = self.decode.placement
        axes = decode.cache_axes(runs)
        head = [
            {k: _positions(v, axes_k[k], written) for k, v in run.items()}  # [layers, B, written, ...]
            for run, axes_k in zip(runs, axes)
        ]
        head, moved = move_cache(head, decode, list(self.prefill.placement.mesh.devices.flat))
        return [
            {k: _zero_tail(v, axes_k[k], max_len, full_t[k]) for k, v in run.items()}
            for run, axes_k, full_t in zip(head, axes, decode.cache_shardings(runs))
        ], moved

    def hand_over(self, state: Prefilled | SpecPrefilled) -> tuple[Prefilled | SpecPrefilled, int, float]:
        """The prefilled batch onto the decode engine's devices -> (state there, cache bytes
        that changed device, milliseconds)."""
        t0 = compile_clock.now()
        cache, moved = self._move_cache(state.cache, state.written, state.max_len)
        changes = dict(cache=cache)
        if isinstance(state, SpecPrefilled):
            # The MTP wrote positions 1 .. written (it sees the prompt shifted by one; a write
            # past the cache's end is dropped).
            (changes["mtp_cache"],), mtp_moved = self._move_cache(
                [state.mtp_cache], min(state.written + 1, state.max_len), state.max_len
            )
            moved += mtp_moved
        jax.block_until_ready(changes)
        t1 = compile_clock.now()
        # The tokens, positions and seeds ([B] arrays; the draft's distribution [B, V] when
        # sampling) go through the host, not counted.
        if isinstance(state, SpecPrefilled):
            changes["state"] = SpecState(
                *map(functools.partial(_via_host, placement=self.decode.placement), state.state, SPEC_STATE_AXES)
            )
        else:
            changes["tok"] = _via_host(state.tok, ("batch",), self.decode.placement)
        return dataclasses.replace(state, **changes), moved, compile_clock.run_ms(t0, t1)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0
    ) -> Generation | SpecGeneration:
        # One batch size both placements can split their rows by.
        multiple = math.lcm(self.prefill.placement.batch_multiple(), self.decode.placement.batch_multiple())
        state = self.prefill.start(prompts, max_new_tokens, sampling, seed, batch_multiple=multiple)
        state, moved, ms = self.hand_over(state)
        gen = self.decode.decode(state, max_new_tokens, sampling)
        gen.handover_bytes, gen.handover_ms = moved, ms
        return gen


def split_devices(prefill_devices: int, decode_devices: int, shared: int) -> tuple[list, list]:
    """Prefill's `prefill_devices` devices and decode's next `decode_devices`, an equal share of
    each process's (every process runs both meshes' programs, SPMD; one process: the machine's
    first P devices, then the next D); both 0: the first `shared` devices for both."""
    devices = jax.devices()
    if not prefill_devices and not decode_devices:
        return devices[:shared], devices[:shared]
    n = jax.process_count()
    local = [[d for d in devices if d.process_index == i] for i in sorted({d.process_index for d in devices})]
    p, d = prefill_devices // n, decode_devices // n
    return [x for ds in local for x in ds[:p]], [x for ds in local for x in ds[p : p + d]]
