"""Physical expert slots: where each logical expert of a MoE layer lives, as data.

With `layout.redundant_experts` R a MoE layer has P = E + R slots (E counting padding experts),
P / ep per device, in slot order. `phy2log int[L, P]` names the logical expert each slot holds
(`sharding/eplb.py`'s contract); the runtime keeps it as a table per layer,

    log2phy  int32 [L, E, R + 1]   the slots of each logical expert, ascending, padded by repeating
                                   the first (R + 1 replicas is the most any expert can have)
    logcnt   int32 [L, E]          replicas of each logical expert

stored beside the layer's experts (`run_params["moe"]["slots"]`), so that it is an input of the
jitted programs: a new placement has the same shapes and never recompiles.

Picks to replicas ("How a Row Meets Its Experts"): the j-th pick of expert e in a pass (rows in
batch order, picks in rank order) goes to replica j mod logcnt[e], the most even split, the same
rule `moejax analyze` scores placements with; `home`: a row first takes a replica on its own device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharding.eplb import logical_maps


def default_phy2log(num_layers: int, num_experts: int, num_slots: int) -> np.ndarray:
    """int[L, P]: the checkpoint order, then one spare replica each of experts 0, 1, ... (a
    placement to start from before any traffic is seen)."""
    order = np.concatenate([np.arange(num_experts), np.arange(num_slots - num_experts) % num_experts])
    return np.broadcast_to(order, (num_layers, num_slots)).copy()


def tables(phy2log: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    """{"log2phy": int32 [L, E, P - E + 1], "logcnt": int32 [L, E]} of a phy2log int[L, P]."""
    phy2log = np.asarray(phy2log)
    width = phy2log.shape[1] - num_experts + 1
    log2phy, logcnt = logical_maps(phy2log, num_experts)
    log2phy = np.where(log2phy < 0, log2phy[..., :1], log2phy)
    pad = np.broadcast_to(log2phy[..., :1], (*log2phy.shape[:2], width - log2phy.shape[2]))
    return {"log2phy": np.concatenate([log2phy, pad], -1).astype(np.int32), "logcnt": logcnt.astype(np.int32)}


def replica_rank(ids: jax.Array) -> jax.Array:
    """ids: [T, k] -> int32 [T, k]: how many earlier picks (batch order, then rank) chose the same expert."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    ordered = flat[order]
    position = jnp.arange(flat.size, dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    rank_ordered = position - jax.lax.cummax(jnp.where(first, position, 0))
    return jnp.zeros_like(position).at[order].set(rank_ordered).reshape(ids.shape)


def pick_slots(ids: jax.Array, table: dict, devices: int = 1, home: bool = False) -> jax.Array:
    """ids: [T, k] logical picks -> int32 [T, k] physical slots, by one layer's `table`
    (log2phy [E, X], logcnt [E]). `home`: a pick takes a replica on its row's own device when
    there is one (rows split over `devices` in contiguous blocks, as the placements lay them)."""
    log2phy, logcnt = table["log2phy"], table["logcnt"]
    spread = jnp.take_along_axis(log2phy[ids], (replica_rank(ids) % logcnt[ids])[..., None], -1)[..., 0]
    if not home:
        return spread
    t = ids.shape[0]
    per_device = (log2phy.shape[1] + log2phy.shape[0] - 1) // devices  # P / devices slots each
    row_device = jnp.arange(t) // -(-t // devices)  # [T]
    candidates = log2phy[ids]  # [T, k, X]
    local = (candidates // per_device == row_device[:, None, None]) & (
        jnp.arange(candidates.shape[-1]) < logcnt[ids][..., None]
    )
    first_local = jnp.take_along_axis(candidates, jnp.argmax(local, -1)[..., None], -1)[..., 0]
    return jnp.where(local.any(-1), first_local, spread)


def host_pick_slots(ids: np.ndarray, table: dict, devices: int = 1, home: bool = False) -> np.ndarray:
    """`pick_slots` in numpy, for counting on the host without compiling a program per shape."""
    log2phy, logcnt = np.asarray(table["log2phy"]), np.asarray(table["logcnt"])
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    position = np.arange(flat.size)
    first = np.ones(flat.size, bool)
    first[1:] = ordered[1:] != ordered[:-1]
    rank = np.empty_like(position)
    rank[order] = position - np.maximum.accumulate(np.where(first, position, 0))
    spread = log2phy[flat, rank % logcnt[flat]].reshape(ids.shape)
    if not home:
        return spread
    t = ids.shape[0]
    per_device = (log2phy.shape[1] + log2phy.shape[0] - 1) // devices
    row_device = np.arange(t) // -(-t // devices)
    candidates = log2phy[ids]  # [T, k, X]
    replica = np.arange(candidates.shape[-1]) < logcnt[ids][..., None]
    local = (candidates // per_device == row_device[:, None, None]) & replica
    first_local = np.take_along_axis(candidates, local.argmax(-1)[..., None], -1)[..., 0]
    return np.where(local.any(-1), first_local, spread)


def device_rows(
    ids: np.ndarray, valid: np.ndarray, phy2log: np.ndarray | None, num_logical: int, devices: int, home: bool = False
) -> np.ndarray:
    """int[N]: rows each device's experts computed in one forward pass, summed over MoE layers:
    ids int[L, R, k] logical picks, valid bool[R], the experts placed by phy2log int[L, P] (None:
    checkpoint order, `num_logical` slots). A row with two picks on one device counts once; the
    picks go to replicas as the run sends them (`home`: the row's own device first)."""
    total = np.zeros(devices, np.int64)
    table = None if phy2log is None else tables(phy2log, num_logical)
    num_slots = num_logical if phy2log is None else phy2log.shape[1]
    for l in range(ids.shape[0]):
        where = ids[l] if table is None else host_pick_slots(ids[l], {k: v[l] for k, v in table.items()}, devices, home)
        device = where[valid] // (num_slots // devices)  # [valid rows, k]
        visits = np.zeros((device.shape[0], devices), bool)
        np.put_along_axis(visits, device, True, axis=-1)
        total += visits.sum(0)
    return total


def balancedness(per_device: np.ndarray) -> float:
    """SGLang's balancedness of per-device counts: mean / max (1.0 when nothing ran)."""
    per_device = np.asarray(per_device, float)
    return float(per_device.mean() / per_device.max()) if per_device.max() > 0 else 1.0
