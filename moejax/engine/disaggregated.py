"""Prefill and decode on their own placements and meshes (seed 1 section 6.6): one engine
prefills, its KV cache is handed to the other engine's layout, and that engine decodes.

Each engine holds its own parameters, placed once on its mesh. The meshes may share devices
(two layouts of the same devices) or split them. The hand-over moves only the cache positions
the prefill wrote (the rest of a cache is zeros, made on the decode side): one `jax.device_put`
of each array's written positions onto the decode placement's cache sharding, which moves only
the shards whose device changes (`bytes_moved` counts them).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from moejax.engine import compile_clock
from moejax.engine.engine import Engine, Generation, Prefilled, to_host
from moejax.engine.sampling import Sampling


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
    elements = sum(_overlap(index, index, shape) - (_overlap(index, have[d], shape) if d in have else 0)
                   for d, index in target.devices_indices_map(shape).items())
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


class Disaggregated:
    """`prefill` prefills, `decode` decodes: two engines of one model on their own placements."""

    def __init__(self, prefill: Engine, decode: Engine):
        self.prefill, self.decode = prefill, decode

    def hand_over(self, state: Prefilled) -> tuple[Prefilled, int, float]:
        """The prefilled batch onto the decode engine's devices -> (state there, cache bytes
        that changed device, milliseconds)."""
        decode = self.decode.placement
        axes = decode.cache_axes(state.cache)
        t0 = compile_clock.now()
        written = [{k: _positions(v, axes_k[k], state.written) for k, v in layer.items()}
                   for layer, axes_k in zip(state.cache, axes)]  # [layers, B, written, ...] on the prefill mesh
        targets = decode.cache_shardings(written)
        moved = sum(bytes_moved(a, layer_t[k]) for layer, layer_t in zip(written, targets) for k, a in layer.items())
        cache = jax.block_until_ready([
            {k: _zero_tail(jax.device_put(v, layer_t[k]), axes_k[k], state.max_len, full_t[k]) for k, v in layer.items()}
            for layer, layer_t, axes_k, full_t in zip(written, targets, axes, decode.cache_shardings(state.cache))])
        t1 = compile_clock.now()
        # The first tokens ([B] int32) go through the host: a handful of bytes, not counted.
        tok = decode.put(to_host(state.tok), ("batch",))
        return (dataclasses.replace(state, cache=cache, tok=tok), moved,
                1e3 * (t1 - t0 - compile_clock.compile_seconds(t0, t1)))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling = Sampling(), seed: int = 0,
                 record: bool = False, return_logits: bool = False) -> Generation:
        # One batch size both placements can split their rows by.
        multiple = math.lcm(self.prefill.placement.batch_multiple(), self.decode.placement.batch_multiple())
        state = self.prefill.start(prompts, max_new_tokens, sampling, seed, record, batch_multiple=multiple)
        state, moved, ms = self.hand_over(state)
        gen = self.decode.decode(state, max_new_tokens, sampling, record, return_logits)
        gen.handover_bytes, gen.handover_ms = moved, ms
        return gen


def split_devices(prefill_devices: int, decode_devices: int, shared: int) -> tuple[list, list]:
    """The machine's first `prefill_devices` devices for prefill and the next `decode_devices`
    for decode; both 0: the first `shared` devices for both."""
    devices = jax.devices()
    if not prefill_devices and not decode_devices:
        return devices[:shared], devices[:shared]
    return devices[:prefill_devices], devices[prefill_devices:prefill_devices + decode_devices]
