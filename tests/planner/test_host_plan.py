"""The host side of ``hybridmem plan`` (hybridmem.planner.host) against sums computed by hand."""

from __future__ import annotations

import pytest

from hybridmem.contract.kinds import StateKind
from hybridmem.planner.host import node_hosts, pinned_nbytes, rank_host_nbytes


@pytest.mark.parametrize("nbytes,rounded", [(0, 0), (1, 1), (3, 4), (4096, 4096), (4097, 8192),
                                            (5 * 10**9, 2**33)])
def test_a_pinned_arena_takes_the_next_power_of_two(nbytes, rounded):
    assert (pinned_nbytes(nbytes, rounds_up=True) == rounded
            and pinned_nbytes(nbytes, rounds_up=False) == nbytes)


def test_a_rank_holds_the_arenas_of_what_it_offloads_and_a_level_1_sleep_copy():
    arenas = {StateKind.PARAM: (100, 4), StateKind.GRAD: (200,), StateKind.OPTIMIZER: (600,)}
    everything = {k: True for k in arenas}
    host = rank_host_nbytes(arenas, offload=everything, weights_nbytes=50, sleep_level=1, framework_nbytes=7,
                            rounds_up=False)
    assert host == {"param arenas": 104, "grad arenas": 200, "optimizer arenas": 600, "engine sleep copy": 50,
                    "training framework": 7}
    # Level 2 discards the weights; a kind kept on the device holds no arena; each dtype's arena is rounded
    # alone.
    host = rank_host_nbytes(arenas, offload={**everything, StateKind.GRAD: False}, weights_nbytes=50,
                            sleep_level=2, framework_nbytes=0, rounds_up=True)
    assert host == {"param arenas": 128 + 4, "grad arenas": 0, "optimizer arenas": 1024,
                    "engine sleep copy": 0, "training framework": 0}
    with pytest.raises(ValueError, match="sleep_level=3"):
        rank_host_nbytes(arenas, offload=everything, weights_nbytes=0, sleep_level=3, framework_nbytes=0,
                         rounds_up=False)


def test_a_node_sums_its_ranks_and_the_last_node_may_be_partial():
    ranks = [{"param arenas": r, "training framework": 1} for r in range(5)]
    nodes = node_hosts(ranks, 2)
    assert [(n.node, n.ranks, n.peak_nbytes) for n in nodes] == [(0, (0, 1), 3), (1, (2, 3), 7), (2, (4,), 5)]
