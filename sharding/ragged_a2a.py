"""Rows travel to their experts: dispatch each row only to the devices that hold at least one
of its picks, run the local experts there, and send the weighted results back (combine).

Buffers follow `jax.lax.ragged_all_to_all`'s offsets/sizes convention and are sized for the
worst case (every row of every device picking this device), so no row is ever dropped:
the send buffer holds one block of T_local slots per destination, the receive buffer one
block of T_local slots per source. On TPU and GPU only the used slots travel
(`ragged_all_to_all`); XLA:CPU lacks that op, so there the same blocks go through a dense
`all_to_all`, empty slots included. Runs inside `shard_map` over ("ep", "tp") with tp = 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from moejax.base.platform import XLA, DecodeKernels, Platform
from sharding import accounting, overlap
from sharding.experts import moe_local
from sharding.mesh import MeshPlacement, own_share
from sharding.rules import ALL


def dispatch_plan(ids: jax.Array, e_local: int, n: int) -> tuple[jax.Array, jax.Array]:
    """ids: [T, k] global expert ids -> (row_of_slot: int32 [n, T] the row in slot s of the block for
    device d, T where none; send_sizes: int32 [n] the slots used). Block d holds the rows with a
    pick on d, in order: slot s's row is the one before which s + 1 rows go to d, so counting the
    rows whose running count is at most s finds it (T where fewer go): a compare and a sum, where a
    scatter of each row to its slot was three kernels a layer on a GPU."""
    t = ids.shape[0]
    goes = jnp.any((ids // e_local)[:, :, None] == jnp.arange(n), axis=1)  # [T, n]: row t goes to d
    before = jnp.cumsum(goes, axis=0, dtype=jnp.int32)  # [T, n]: rows up to t going to d
    slots = jnp.arange(t, dtype=jnp.int32)[None, :, None]  # [1, S, 1]
    row_of_slot = jnp.sum(before.T[:, None, :] <= slots, axis=-1, dtype=jnp.int32)  # [n, S]
    return row_of_slot, before[-1]


def _exchange(
    x: jax.Array, sizes: jax.Array, recv_sizes: jax.Array, use_ragged: bool, fill: jax.Array | None = None
) -> jax.Array:
    """x: [n, S, ...] block b goes to device b -> [n, S, ...] block b came from device b.
    `sizes[b]`: used slots of block b (what a ragged exchange sends); `recv_sizes[b]`: those of the
    block device b sends here (the exchange of counts, once a layer); `fill` [...]: what a ragged
    exchange leaves in the slots nothing arrived in (default zeros; a dense one sends them)."""
    n, s = x.shape[:2]
    if not use_ragged:
        return jax.lax.all_to_all(x, ALL, 0, 0, tiled=True)
    me = jax.lax.axis_index(ALL)
    flat = x.reshape(n * s, *x.shape[2:])
    out = jnp.zeros_like(flat) if fill is None else jnp.broadcast_to(fill, flat.shape)
    offsets = jnp.arange(n, dtype=jnp.int32) * s
    out = jax.lax.ragged_all_to_all(
        flat, out, offsets, sizes, jnp.full((n,), me * s, jnp.int32), recv_sizes, axis_name=ALL
    )
    return out.reshape(x.shape)


def _as_columns(a: jax.Array, dtype) -> jax.Array:
    """int32 or f32 [..., kk] -> [..., kk * 4 / itemsize] of `dtype`, bit for bit: picks riding in a row."""
    out = jax.lax.bitcast_convert_type(a, dtype)
    return out.reshape(*a.shape[:-1], -1)


def _from_columns(a: jax.Array, dtype, kk: int) -> jax.Array:
    """`_as_columns`' inverse: [..., kk * 4 / itemsize] -> [..., kk] of `dtype` (int32 or f32)."""
    ratio = 4 // a.dtype.itemsize
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], kk, ratio) if ratio > 1 else a, dtype)


def _dispatch(rows, ids, weights, sizes, recv_sizes, dispatch_dtype: str, use_ragged: bool, unused: int):
    """Rows [n, S, D] with their picks' ids and weights [n, S, kk] to the blocks' devices: one
    exchange, the picks bit for bit in columns after each row's (4-byte ids and weights in a 2-
    or 4-byte row), or, rows as NVFP4 (values, block and row scales), an exchange per array. A
    slot nothing arrived in holds the expert id `unused` (nobody's: its picks compute nothing)."""
    kk = ids.shape[-1]
    no_ids = jnp.full((kk,), unused, ids.dtype)
    if dispatch_dtype != "nvfp4" and 4 % rows.dtype.itemsize == 0:
        packed = jnp.concatenate([rows, _as_columns(ids, rows.dtype), _as_columns(weights, rows.dtype)], axis=-1)
        fill = (
            jnp.zeros(packed.shape[-1:], rows.dtype)
            .at[rows.shape[-1] :]
            .set(
                jnp.concatenate(
                    [_as_columns(no_ids, rows.dtype), _as_columns(jnp.zeros((kk,), weights.dtype), rows.dtype)]
                )
            )
        )
        got = _exchange(packed, sizes, recv_sizes, use_ragged, fill)
        d, width = rows.shape[-1], (got.shape[-1] - rows.shape[-1]) // 2
        return (
            got[..., :d],
            _from_columns(got[..., d : d + width], ids.dtype, kk),
            _from_columns(got[..., d + width :], weights.dtype, kk),
        )
    exchange = functools.partial(_exchange, sizes=sizes, recv_sizes=recv_sizes, use_ragged=use_ragged)
    if dispatch_dtype != "nvfp4":
        return exchange(rows), exchange(ids, fill=no_ids), exchange(weights)
    q = pallas_kernels.quantize_rows(rows.reshape(-1, rows.shape[-1]).astype(jnp.float32), "nvfp4")
    n, s = rows.shape[:2]
    q = jax.tree.map(lambda a: exchange(a.reshape(n, s, *a.shape[1:])).reshape(a.shape), q)
    return pallas_kernels.dequantize(q, rows.dtype).reshape(rows.shape), exchange(ids, fill=no_ids), exchange(weights)


def local_picks(k: int, e_local: int) -> int:
    """Picks a received row can have on its device: it picked k distinct experts, E_local of
    which are there."""
    return min(k, e_local)


def exchange_buffers(
    t_local: int, n: int, k: int, e_local: int, hidden: int, act_bytes: int, dispatch_row_bytes: int
) -> dict[str, int]:
    """Bytes of each buffer one device allocates for one MoE layer of a pass with t_local rows
    per device. Sized for the worst case (every row of every device picking this device), so no
    row is ever dropped: send and receive blocks of t_local slots per peer, each row with its
    kk = min(k, E_local) local picks (int32 id + f32 weight), and the kk-fold expanded rows the
    local experts run on."""
    kk = local_picks(k, e_local)
    slots = n * t_local
    return {
        "dispatch_send": slots * (dispatch_row_bytes + kk * 8),
        "dispatch_recv": slots * (dispatch_row_bytes + kk * 8),
        "expert_rows": slots * kk * hidden * act_bytes,
        "combine_send": slots * hidden * act_bytes,
        "combine_recv": slots * hidden * act_bytes,
    }


def ragged_phases(
    w,
    *,
    num_experts: int,
    dispatch_dtype: str,
    use_ragged: bool,
    kernel: str,
    platform: Platform,
    decode: DecodeKernels = XLA,
) -> overlap.Phases:
    """The exchange of one device's rows x: [T, D], ids/weights: [T, k] as its three phases
    (`kernel` runs the experts as on `platform`, a decode step's with the `decode` kernels)."""
    e_local = w["down"].shape[0]

    def dispatch(x, ids, weights):
        t, k = ids.shape
        n = jax.lax.axis_size(ALL)
        row_of_slot, send_sizes = dispatch_plan(ids, e_local, n)  # [n, T], [n]
        # Send buffer [n, T, ...]: block d holds the rows going to d, with only d's picks kept.
        # Unused slots keep the sentinel expert `num_experts` (nobody's) and so compute nothing.
        valid = row_of_slot < t
        safe = jnp.where(valid, row_of_slot, 0)
        pick_dev = ids[safe] // e_local  # [n, T, k]
        keep = valid[..., None] & (pick_dev == jnp.arange(n)[:, None, None])
        # A row carries only the picks of the device it goes to, at most kk = min(k, E_local) of
        # them: its kept picks first (stable), then cut to kk, so the receiver computes kk picks
        # per received row and not k.
        kk = local_picks(k, e_local)
        if kk < k:
            first = jnp.argsort(~keep, axis=-1, stable=True)[..., :kk]  # [n, T, kk]
            take = lambda a: jnp.take_along_axis(a, first, axis=-1)
        else:  # every pick may be local: none to cut, in any order
            take = lambda a: a
        send_ids = jnp.where(take(keep), take(ids[safe]), num_experts)
        send_w = jnp.where(take(keep), take(weights[safe]), 0.0)

        # The counts' exchange, once a layer: the combine sends back what the dispatch brought.
        recv_sizes = jax.lax.all_to_all(send_sizes, ALL, 0, 0, tiled=True)
        recv_rows, recv_ids, recv_w = _dispatch(
            x[safe], send_ids, send_w, send_sizes, recv_sizes, dispatch_dtype, use_ragged, num_experts
        )
        return recv_rows, recv_ids, recv_w, (send_sizes, recv_sizes), row_of_slot

    def compute(sent):
        recv_rows, recv_ids, recv_w, sizes, row_of_slot = sent  # [n, T, D], [n, T, kk] x 2, ([n], [n]), [n, T]
        n, t, kk = recv_ids.shape
        y = moe_local(
            recv_rows.reshape(n * t, -1),
            recv_ids.reshape(n * t, kk),
            recv_w.reshape(n * t, kk),
            w,
            num_groups=num_experts + 1,
            group_offset=jax.lax.axis_index(ALL) * e_local,
            kernel=kernel,
            platform=platform,
            decode=decode,
        )
        return y.reshape(n, t, -1), sizes, row_of_slot

    def combine(done):
        y, (send_sizes, recv_sizes), row_of_slot = done
        back = _exchange(y, recv_sizes, send_sizes, use_ragged)  # each block back where it came from
        # Sum each row's results from the devices it went to (row T: a slot nobody used, dropped).
        t = row_of_slot.shape[1]
        return (
            jnp.zeros((t, y.shape[-1]), y.dtype)
            .at[row_of_slot.reshape(-1)]
            .add(back.reshape(-1, y.shape[-1]), mode="drop")
        )

    return overlap.Phases(dispatch, compute, combine)


class RaggedA2A(MeshPlacement):
    """Whole experts, E/N per device (an N x 1 mesh); rows travel to the devices of their picks."""

    name = "ragged_a2a"
    home_replicas = True  # a replica on the row's own device saves the row its trip

    def __init__(self, config, mesh=None, platform: Platform | None = None, use_ragged: bool | None = None):
        super().__init__(config, mesh, platform)
        # Only the used slots travel where the platform has a ragged all-to-all (`moejax.base.platform`).
        self.use_ragged = self.platform.ragged_all_to_all if use_ragged is None else use_ragged
        if not self.use_ragged:
            self.sent_source = "exchange plan (this backend sends whole buffers)"

    @classmethod
    def mesh_shape(cls, layout):
        return cls.fixed_mesh(layout, (layout.devices, 1))

    def exchange(self, x, ids, weights, w):
        phases = ragged_phases(
            w,
            num_experts=self.num_experts,
            dispatch_dtype=self.config.layout.dispatch_dtype,
            use_ragged=self.use_ragged,
            kernel=self.kernel,
            platform=self.platform,
            decode=self.decode,
        )
        inner = functools.partial(overlap.run, phases, self.two_batch_overlap)
        return inner(x, ids, weights) if self.rows_sharded else own_share(inner, x, ids, weights)

    # ------------------------------------------------------------------ accounting
    def dispatch_row_bytes(self, hidden: int, act_bytes: int) -> int:
        """Bytes of one row as it travels."""
        if self.config.layout.dispatch_dtype == "nvfp4":
            return hidden // 2 + hidden // 16 + 4  # e2m1 values, e4m3 block scales, f32 row scale
        return hidden * act_bytes

    def exchange_buffer_bytes(self, rows, hidden, act_bytes):
        k = self.config.model.num_experts_per_tok
        return exchange_buffers(
            -(-rows // self.devices),
            self.devices,
            k,
            self.num_experts // self.ep,
            hidden,
            act_bytes,
            self.dispatch_row_bytes(hidden, act_bytes),
        )

    def sent_rows(self, ids: np.ndarray) -> np.ndarray:
        """sent[s, d]: rows device s dispatches to another device d (the exchange's own plan)."""
        n = self.devices
        shares = np.array_split(np.asarray(ids), n)
        sent = np.stack([np.asarray(dispatch_plan(s, self.num_experts // self.ep, n)[1]) for s in shares])
        np.fill_diagonal(sent, 0)
        return sent

    def bytes_sent_per_device(self, ids, hidden, act_bytes, experts=None):
        if self.devices == 1:
            return np.zeros(1)
        sent, kk = self.sent_rows(ids), local_picks(ids.shape[1], self.num_experts // self.ep)
        dispatch = sent.sum(1) * (self.dispatch_row_bytes(hidden, act_bytes) + kk * accounting.PICK_BYTES)
        combine = sent.sum(0) * hidden * act_bytes  # results go back to the rows' devices
        return (dispatch + combine + self.gathered_results_bytes(ids.shape[0], hidden, act_bytes)).astype(float)

    def copies_per_row(self, ids):
        return float(self.sent_rows(ids).sum() / ids.shape[0])
