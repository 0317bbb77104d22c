"""A rank's messages between machines leave its link one after another (issue 49, the bandwidth link): each holds
the link for its bytes' time, their latencies overlap. Without it a model on a 100 Mbit link let GPipe's and the
interleaved schedules' bursts of messages cross at once, and priced them 11-21 % low at 4 processes. Hand-computed
timings, no processes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stagewise import build_schedule, simulate
from stagewise.simulation import CostModel, shared_makespan

GPIPE = build_schedule("gpipe", 2, 3)


def link(bandwidth: float = 1.0) -> CostModel:
    """2 stages of F 1 s and B 1 s (I 0.5 + W 0.5), 2 bytes out of each, a link of 0.5 s latency and
    ``bandwidth`` bytes/s between the two ranks (each a machine of its own)."""
    costs = CostModel.uniform(2, forward=1.0, backward_input=0.5, backward_weight=0.5, comm_time=0.5)
    return replace(costs, output_bytes=(2.0, 2.0), bandwidth=bandwidth)


def test_a_burst_of_messages_leaves_one_after_another() -> None:
    """Rank 0's F end at 1, 2, 3 s; each message holds the link 2 s, so they leave at 1, 3, 5 and arrive 2.5 s
    later: 3.5, 5.5, 7.5. Rank 1's F run 3.5-4.5, 5.5-6.5, 7.5-8.5 and its B 8.5-11.5, whose gradients leave at
    9.5, 11.5, 13.5 and arrive at 12, 14, 16: rank 0's last B ends at 17 s. Each message alone would arrive 2.5 s
    after its end: 13 s. An unbounded link (latency alone) is unchanged by the queue."""
    run = simulate(GPIPE, link())
    assert run.makespan == pytest.approx(17.0)
    rank1 = [e for e in run.timeline.events if e.rank == 1]
    assert [e.start for e in rank1[:3]] == pytest.approx([3.5, 5.5, 7.5])
    assert shared_makespan(GPIPE, link(), [1.0, 1.0], cores=2.0) == pytest.approx(17.0)
    slow_once = replace(link(math.inf), latency=2.5)  # every message 2.5 s, none holding the link
    assert simulate(GPIPE, slow_once).makespan == pytest.approx(13.0)


def test_inside_a_machine_nothing_queues() -> None:
    """Both ranks on one machine: the local link is the sender's memory copy; the messages overlap (13 s)."""
    local = replace(link(math.inf), rank_nodes=(0, 0), local_latency=0.5, local_bandwidth=1.0)
    assert simulate(GPIPE, local).makespan == pytest.approx(13.0)
    assert shared_makespan(GPIPE, local, [1.0, 1.0], cores=2.0) == pytest.approx(13.0)


def test_each_replica_sends_its_own_copy() -> None:
    """A pipeline rank of two processes (its data-parallel replicas, weight 2) sends two copies over the link: 4 s
    a message, the last copy in 0.5 s after. Rank 0's messages leave at 1, 5, 9 and arrive at 5.5, 9.5, 13.5; rank
    1's F run 5.5, 9.5, 13.5 (to 14.5), its B 14.5-17.5, the gradients leave at 15.5, 19.5, 23.5 and arrive at
    20, 24, 28: 29 s. Cores enough for both replicas, so only the link slows it."""
    assert shared_makespan(GPIPE, link(), [2.0, 2.0], cores=4.0) == pytest.approx(29.0)
