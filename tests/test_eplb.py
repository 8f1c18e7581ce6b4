"""EPLB against small cases worked out by hand (comments give the working)."""

import numpy as np
import pytest

from sharding import eplb


def test_packing_puts_heaviest_item_into_lightest_pack():
    # 4 -> p0, 3 -> p1, 2 -> p1 (3 < 4), 1 -> p0: both packs weigh 5
    pack, rank = eplb.balanced_packing(np.array([[4.0, 3.0, 2.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1]]


def test_packing_fills_every_pack_to_the_same_item_count():
    # 10 -> p0, 1 -> p1, 1 -> p1, then p1 is full so the last 1 goes to p0 despite its weight
    pack, _ = eplb.balanced_packing(np.array([[10.0, 1.0, 1.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]]


def test_packing_one_item_per_pack_keeps_the_order():
    pack, rank = eplb.balanced_packing(np.array([[1.0, 9.0, 5.0]]), 3)
    assert pack.tolist() == [[0, 1, 2]] and rank.tolist() == [[0, 0, 0]]


def test_replicas_go_to_the_highest_load_per_replica():
    # [6, 4, 2, 1]: first spare to expert 0 (6 -> 3 per replica), second to expert 1 (4 > 3)
    phy2log, rank, logcnt = eplb.replicate_experts(np.array([[6.0, 4.0, 2.0, 1.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert rank.tolist() == [[0, 0, 0, 0, 1, 1]]
    assert logcnt.tolist() == [[2, 2, 1, 1]]


def test_global_policy_when_groups_do_not_divide_nodes():
    # 1 group on 2 nodes -> global. Replicas as above, loads per slot [3, 2, 2, 1, 3, 2]; packing
    # 3 slots per GPU heaviest first: s0 -> g0, s4 -> g1, s1 -> g0 (tie), s2 -> g1, s5 -> g0, s3 -> g1.
    # g0 = slots (0, 1, 5) = experts (0, 1, 1); g1 = slots (4, 2, 3) = experts (0, 2, 3); loads 7 and 6.
    phy2log, log2phy, logcnt = eplb.rebalance_experts(np.array([[6.0, 4.0, 2.0, 1.0]]), 6, 1, 2, 2)
    assert phy2log.tolist() == [[0, 1, 1, 0, 2, 3]]
    assert logcnt.tolist() == [[2, 2, 1, 1]]
    assert log2phy.tolist() == [[[0, 3], [1, 2], [4, -1], [5, -1]]]


def test_hierarchical_policy_packs_groups_onto_nodes_then_experts_onto_gpus():
    # 8 experts in 4 groups of 2, loads [1,1 | 5,5 | 2,2 | 4,4], 2 nodes of 2 GPUs.
    # Groups to nodes: g1 (10) -> n0, g3 (8) -> n1, g2 (4) -> n1, g0 (2) -> n0: 12 each.
    # Node 0 holds experts 2,3 (5 each) and 0,1 (1 each): GPUs get {2, 0} and {3, 1}; node 1 likewise
    # {6, 4} and {7, 5}. Every GPU carries 6.
    weight = np.array([[1.0, 1.0, 5.0, 5.0, 2.0, 2.0, 4.0, 4.0]])
    phy2log, _, logcnt = eplb.rebalance_experts(weight, 8, 4, 2, 4)
    assert phy2log.tolist() == [[2, 0, 3, 1, 6, 4, 7, 5]]
    assert logcnt.tolist() == [[1] * 8]


def test_hierarchical_policy_replicates_within_a_node():
    # Groups {0, 1} and {2, 3} on one node each (one GPU per node); each node gets one spare slot, which
    # goes to its hottest expert: 1 (load 2) on node 0, 2 (load 5) on node 1. Within a GPU, slots are
    # ranked heaviest first: node 1's slots carry 2.5 (expert 2), 4 (expert 3), 2.5 (expert 2) -> 3, 2, 2.
    phy2log, _, logcnt = eplb.rebalance_experts(np.array([[1.0, 2.0, 5.0, 4.0]]), 6, 2, 2, 2)
    assert phy2log.tolist() == [[0, 1, 1, 3, 2, 2]]
    assert logcnt.tolist() == [[1, 2, 2, 1]]


def test_rebalance_works_per_layer():
    # Layer 1 mirrors layer 0's loads: spares to experts 3 and 2, slot loads [1, 2, 2, 3, 3, 2];
    # packing: s3 -> g0, s4 -> g1, s1 -> g0, s2 -> g1, s5 -> g0, s0 -> g1.
    weight = np.array([[6.0, 4.0, 2.0, 1.0], [1.0, 2.0, 4.0, 6.0]])
    phy2log, _, _ = eplb.rebalance_experts(weight, 6, 1, 1, 2)
    assert phy2log.tolist() == [[0, 1, 1, 0, 2, 3], [3, 1, 2, 3, 2, 0]]


def test_bytes_variant_balances_touch_probabilities_without_replicas():
    # 0.9 -> g0, 0.8 -> g1, 0.3 -> g1, 0.2 -> g0: 1.1 each
    phy2log, log2phy, logcnt = eplb.rebalance_for_bytes(np.array([[0.9, 0.8, 0.3, 0.2]]), 2)
    assert phy2log.tolist() == [[0, 3, 1, 2]]
    assert logcnt.tolist() == [[1, 1, 1, 1]]
    assert log2phy[0, :, 0].tolist() == [0, 2, 3, 1]


def test_logical_maps_list_replicas_in_slot_order():
    log2phy, logcnt = eplb.logical_maps(np.array([[1, 0, 1, 2]]), 3)
    assert logcnt.tolist() == [[1, 2, 1]]
    assert log2phy.tolist() == [[[1, -1], [0, 2], [3, -1]]]


def test_logical_maps_reject_an_expert_without_a_slot():
    with pytest.raises(ValueError, match="without a slot"):
        eplb.logical_maps(np.array([[0, 0, 1]]), 3)


def test_contiguous_is_the_identity_per_layer():
    assert eplb.contiguous(2, 4).tolist() == [[0, 1, 2, 3]] * 2
