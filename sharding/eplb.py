"""Expert placement: DeepSeek's EPLB in numpy, plus a decode variant that balances bytes read.

Placement contract (what the placements accept as the expert order):

    phy2log  int[L, P]        physical slot p of layer l holds logical expert phy2log[l, p];
                              slot p lives on device p // (P / N), so P must be a multiple of N.
    log2phy  int[L, E, X]     the slots holding each logical expert, ascending, padded with -1
    logcnt   int[L, E]        replicas of each logical expert (>= 1; sums to P per layer)

P = E is a permutation of the experts (no replicas); P = E + spare slots replicates hot experts.
The contiguous (checkpoint) order is phy2log[l] = arange(E).

`rebalance_experts` follows deepseek-ai/EPLB `eplb.py` step for step; two deliberate differences:
ties in the descending sort are broken by the lower index (a stable sort; torch's sort is not
stable), and log2phy lists a logical expert's slots in ascending slot order rather than by replica
rank, so that it is a function of phy2log alone (`logical_maps`).
"""

from __future__ import annotations

import numpy as np


def contiguous(num_layers: int, num_experts: int) -> np.ndarray:
    """int[L, E]: the checkpoint order, experts E/N at a time per device."""
    return np.broadcast_to(np.arange(num_experts), (num_layers, num_experts)).copy()


def logical_maps(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(log2phy int[L, E, X], logcnt int[L, E]) of a phy2log int[L, P], replicas in ascending slot order."""
    num_layers, num_slots = phy2log.shape
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    for l in range(num_layers):
        logcnt[l] = np.bincount(phy2log[l], minlength=num_experts)
    if logcnt.min() < 1:
        raise ValueError("phy2log leaves a logical expert without a slot")
    log2phy = np.full((num_layers, num_experts, logcnt.max()), -1, dtype=np.int64)
    for l in range(num_layers):
        slots = np.argsort(phy2log[l], kind="stable")  # grouped by expert, ascending slot within
        rank = np.arange(num_slots) - np.repeat(np.cumsum(logcnt[l]) - logcnt[l], logcnt[l])
        log2phy[l, phy2log[l, slots], rank] = slots
    return log2phy, logcnt


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs n weighted items into num_packs packs of exactly n / num_packs items each, greedily
    (heaviest item first into the lightest pack that still has room).

    weight float[X, n] -> (pack_index int[X, n], rank_in_pack int[X, n])."""
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    pack_index = np.full((rows, n), -1, dtype=np.int64)
    rank_in_pack = np.full((rows, n), -1, dtype=np.int64)
    order = np.argsort(-weight, axis=-1, kind="stable")
    for i in range(rows):
        loads = [0.0] * num_packs
        items = [0] * num_packs
        for item in order[i]:
            pack = min((p for p in range(num_packs) if items[p] < per_pack), key=loads.__getitem__)
            pack_index[i, item] = pack
            rank_in_pack[i, item] = items[pack]
            loads[pack] += float(weight[i, item])
            items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adds replicas one at a time to the expert with the highest load per replica, which minimizes
    the largest load of any replica.

    weight float[X, n] -> (phy2log int[X, num_physical], rank int[X, num_physical], logcnt int[X, n])."""
    rows, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} experts")
    phy2log = np.broadcast_to(np.arange(num_physical), (rows, num_physical)).copy()
    rank = np.zeros((rows, num_physical), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    every = np.arange(rows)
    for slot in range(n, num_physical):
        hottest = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[every, hottest]
        logcnt[every, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's hierarchical policy: pack expert groups onto nodes, replicate hot experts within
    each node, then pack each node's physical experts onto its GPUs.

    weight float[L, E] (picks per expert) -> (phy2log int[L, P], phyrank int[L, P], logcnt int[L, E])."""
    num_layers, num_logical = weight.shape
    if num_logical % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_physical % num_gpus:
        raise ValueError(
            f"E={num_logical}, groups={num_groups}, nodes={num_nodes}, gpus={num_gpus}, "
            f"slots={num_physical} do not nest"
        )
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # Step 1: groups to nodes. mlog ("meta-logical") numbers experts node by node.
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[..., None] + np.arange(group_size)).reshape(
        num_layers, num_logical
    )
    mlog2log = _inverse(log2mlog)

    # Step 2: replicas within each node. [L * nodes, E / nodes]
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=-1).reshape(-1, num_logical // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # Step 3: a node's physical experts to its GPUs, each replica carrying an equal share of the load.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, axis=-1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack_index * slots_per_gpu + rank_in_pack)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=-1)
    pphy2mlog = (
        pphy2mlog.reshape(num_layers, num_nodes, -1)
        + np.arange(0, num_logical, num_logical // num_nodes)[None, :, None]
    ).reshape(num_layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=-1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=-1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, axis=-1)
    return phy2log, pphyrank, logcnt


def rebalance_experts(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB entry point: hierarchical when the expert groups divide over the nodes, else the global
    policy (one group, one node: replicate and pack over all GPUs).

    weight float[L, E] -> (phy2log int[L, P], log2phy int[L, E, X], logcnt int[L, E]); contract above."""
    weight = np.asarray(weight, dtype=np.float64)
    if num_groups % num_nodes == 0:
        phy2log, _, _ = rebalance_experts_hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus)
    else:
        phy2log, _, _ = rebalance_experts_hierarchical(weight, num_physical, 1, 1, num_gpus)
    return (phy2log, *logical_maps(phy2log, weight.shape[1]))


def rebalance_for_bytes(touch_prob: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode variant: balance the expert bytes each device reads per step, not its picks.

    A decode step's expert time on a device follows the bytes of the distinct experts it touches
    (Row-Meets-Experts §2 and §5.4), and every touched expert costs the same bytes. A device's expected
    bytes per step are therefore proportional to the sum of its experts' probabilities of being
    touched in a step, and we pack those probabilities. Replicas would only add bytes (each touched
    replica is read in full), so this variant uses exactly E slots.

    touch_prob float[L, E] -> (phy2log int[L, E], log2phy int[L, E, 1], logcnt int[L, E])."""
    touch_prob = np.asarray(touch_prob, dtype=np.float64)
    pack_index, rank_in_pack = balanced_packing(touch_prob, num_gpus)
    phy2log = _inverse(pack_index * (touch_prob.shape[1] // num_gpus) + rank_in_pack)
    return (phy2log, *logical_maps(phy2log, touch_prob.shape[1]))
