"""Rows travel to their experts: dispatch each row only to the devices that hold at least one
of its picks, run the local experts there, and send the weighted results back (combine).

Buffers follow `jax.lax.ragged_all_to_all`'s offsets/sizes convention and are sized for the
worst case (every row of every device picking this device), so no row is ever dropped:
the send buffer holds one block of T_local slots per destination, the receive buffer one
block of T_local slots per source. On TPU and GPU only the used slots travel
(`ragged_all_to_all`); XLA:CPU lacks that op, so there the same blocks go through a dense
`all_to_all`, empty slots included. Every device's picks (ids and weights, a few KB) go to every
device first, by one all-gather: from them each device plans its sends, the counts both ways and
the picks of every slot it receives, so the rows travel alone and arrive ready for the experts.
Runs inside `shard_map` over ("ep", "tp") with tp = 1.
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


def _goes(ids: jax.Array, e_local: int, n: int) -> jax.Array:
    """ids: [..., T, k] global expert ids -> bool [..., T, n]: row t has a pick on device d. The k
    picks compared one at a time (no reduction)."""
    dev = ids // e_local
    return functools.reduce(jnp.logical_or, [dev[..., j, None] == jnp.arange(n) for j in range(ids.shape[-1])])


def _slots(before: jax.Array) -> jax.Array:
    """before: [..., T, n] rows up to t going to d -> [..., n, S] the row in slot s of block d (T
    where none): slot s's row is the one before which s + 1 rows go to d, so counting the rows whose
    running count is at most s finds it."""
    slots = jnp.arange(before.shape[-2], dtype=jnp.int32)[:, None]  # [S, 1]
    return jnp.sum(jnp.swapaxes(before, -1, -2)[..., None, :] <= slots, axis=-1, dtype=jnp.int32)


def dispatch_plan(ids: jax.Array, e_local: int, n: int) -> tuple[jax.Array, jax.Array]:
    """ids: [T, k] global expert ids -> (row_of_slot: int32 [n, T] the row in slot s of the block for
    device d, T where none; send_sizes: int32 [n] the slots used). Block d holds the rows with a
    pick on d, in order (`_slots`): a compare and a sum, where a scatter of each row to its slot was
    three kernels a layer on a GPU."""
    before = jnp.cumsum(_goes(ids, e_local, n), axis=0, dtype=jnp.int32)  # [T, n]: rows up to t going to d
    return _slots(before), before[-1]


def _exchange(x: jax.Array, sizes: jax.Array, recv_sizes: jax.Array, use_ragged: bool) -> jax.Array:
    """x: [n, S, ...] block b goes to device b -> [n, S, ...] block b came from device b.
    `sizes[b]`: used slots of block b (what a ragged exchange sends); `recv_sizes[b]`: those of the
    block device b sends here. A ragged exchange leaves zeros in the slots nothing arrived in (a
    buffer of zeros costs no kernel of its own: the compiler makes every layer's in one); a dense one
    sends them."""
    n, s = x.shape[:2]
    if not use_ragged:
        return jax.lax.all_to_all(x, ALL, 0, 0, tiled=True)
    me = jax.lax.axis_index(ALL)
    flat = x.reshape(n * s, *x.shape[2:])
    offsets = jnp.arange(n, dtype=jnp.int32) * s
    out = jax.lax.ragged_all_to_all(
        flat, jnp.zeros_like(flat), offsets, sizes, jnp.full((n,), me * s, jnp.int32), recv_sizes, axis_name=ALL
    )
    return out.reshape(x.shape)


def _dispatch(rows: jax.Array, sizes, recv_sizes, dispatch_dtype: str, use_ragged: bool) -> jax.Array:
    """Rows [n, S, D] to the blocks' devices: one exchange, or, rows as NVFP4 (values, block and row
    scales), an exchange per array."""
    exchange = functools.partial(_exchange, sizes=sizes, recv_sizes=recv_sizes, use_ragged=use_ragged)
    if dispatch_dtype != "nvfp4":
        return exchange(rows)
    q = pallas_kernels.quantize_rows(rows.reshape(-1, rows.shape[-1]).astype(jnp.float32), "nvfp4")
    n, s = rows.shape[:2]
    q = jax.tree.map(lambda a: exchange(a.reshape(n, s, *a.shape[1:])).reshape(a.shape), q)
    return pallas_kernels.dequantize(q, rows.dtype).reshape(rows.shape)


def local_picks(k: int, e_local: int) -> int:
    """Picks a received row can have on its device: it picked k distinct experts, E_local of
    which are there."""
    return min(k, e_local)


def exchange_buffers(
    t_local: int, n: int, k: int, e_local: int, hidden: int, act_bytes: int, dispatch_row_bytes: int
) -> dict[str, int]:
    """Bytes of each buffer one device allocates for one MoE layer of a pass with t_local rows
    per device. Sized for the worst case (every row of every device picking this device), so no
    row is ever dropped: every device's picks (int32 id + f32 weight each), send and receive blocks
    of t_local slots per peer, and the kk-fold expanded rows the local experts run on, kk =
    min(k, E_local) local picks per received row."""
    kk = local_picks(k, e_local)
    slots = n * t_local
    return {
        "picks": slots * k * accounting.PICK_BYTES,
        "dispatch_send": slots * dispatch_row_bytes,
        "dispatch_recv": slots * dispatch_row_bytes,
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
        n, me = jax.lax.axis_size(ALL), jax.lax.axis_index(ALL)
        # The picks' exchange, once a layer: every device's ids and weights [n, T, k], from which each
        # device plans its own sends and what it receives (the counts, and each received slot's
        # picks), so the rows travel alone.
        all_ids, all_w = jax.lax.all_gather((ids, weights), ALL)
        goes = _goes(all_ids, e_local, n)  # [n, T, n]: device b's row t has a pick on device d
        before = jnp.cumsum(goes, axis=1, dtype=jnp.int32)  # [n, T, n]
        send_sizes, recv_sizes = before[me, -1], before[:, -1, me]  # [n], [n]
        row_of_slot = _slots(before[me])  # [n, S]: block d's rows
        # A row brings only its picks on this device, at most kk = min(k, E_local) of them: its kept
        # picks first (stable), then cut to kk, so the receiver computes kk picks per received row
        # and not k; the others name the sentinel expert `num_experts` (nobody's) with weight 0.
        keep = all_ids // e_local == me  # [n, T, k]
        kk = local_picks(k, e_local)
        if kk < k:
            first = jnp.argsort(~keep, axis=-1, stable=True)[..., :kk]  # [n, T, kk]
            take = lambda a: jnp.take_along_axis(a, first, axis=-1)
        else:  # every pick may be local: none to cut, in any order
            take = lambda a: a
        mine_ids = jnp.where(take(keep), take(all_ids), num_experts)  # [n, T, kk]
        mine_w = jnp.where(take(keep), take(all_w), 0.0)
        # Slot s of device b's block here holds b's row t that is the (s + 1)-th of b's rows coming
        # here: its picks are found by a compare and a min (a sum for the weights) over t.
        into = (before[:, :, me] == jnp.arange(1, t + 1)[:, None, None]) & goes[:, :, me]  # [S, n, T]
        into = jnp.moveaxis(into, 0, 1)[..., None]  # [n, S, T, 1]
        recv_ids = jnp.min(jnp.where(into, mine_ids[:, None], num_experts), axis=2)  # [n, S, kk]
        recv_w = jnp.sum(jnp.where(into, mine_w[:, None], 0.0), axis=2)
        rows = x[jnp.minimum(row_of_slot, t - 1)]  # [n, S, D]: slots past a block's size are not sent
        recv_rows = _dispatch(rows, send_sizes, recv_sizes, dispatch_dtype, use_ragged)
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
        n, (t, k) = self.devices, ids.shape
        sent = self.sent_rows(ids)
        picks = (n - 1) * -(-t // n) * k * accounting.PICK_BYTES  # every device's picks to every other
        dispatch = sent.sum(1) * self.dispatch_row_bytes(hidden, act_bytes)
        combine = sent.sum(0) * hidden * act_bytes  # results go back to the rows' devices
        return (picks + dispatch + combine + self.gathered_results_bytes(t, hidden, act_bytes)).astype(float)

    def copies_per_row(self, ids):
        return float(self.sent_rows(ids).sum() / ids.shape[0])
