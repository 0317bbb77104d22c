"""The planner prices a message's CPU between nodes (``Calibration.link_cpu``, issue 49), as the calibrated
replay does (tests/core/test_link_cpu.py): over 100 Mbit/s the pipeline's compute ran 26-57 % slower than over
a fast link, more for the schedules that send more, which a planner pricing the wire alone ranks too well.

GPipe by hand: 2 layers, F 1 s and B 0 s each, 2 micro-batches of one sample, every message 1 s on the link
(1 byte at 1 byte/s), 2 processes on 2 nodes of one core each: 6 s without the share, 19/3 s at 0.5, 6.5 s at
1 (the replay's own hand-worked steps); inside one node, or with a spare core on each, the share costs nothing.
"""

from __future__ import annotations

import pytest

from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Calibration, Link, search


def _gpipe_step(share: float, nodes: int = 2, cores: float | None = None) -> float:
    layer = LayerCost("l", 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0)
    profile = LayerProfile((layer, layer), "synthetic", 1, 0, batch=1)
    cal = Calibration(intra=Link(0.0, 1.0), inter=Link(0.0, 1.0), link_cpu=share)
    found = search(profile, 2, nodes=nodes, global_batch=2, calibration=cal, schedules=["gpipe"], recompute=(None,),
                   top=1000, cores=cores).plans  # fmt: skip
    (plan,) = [p for p in found if p.layout.pp == 2 and p.microbatches == 2]
    return plan.step_time


@pytest.mark.parametrize(("share", "expected"), [(0.0, 6.0), (0.5, 19 / 3), (1.0, 6.5)])
def test_a_pipeline_across_nodes_pays_the_messages_cpu(share: float, expected: float) -> None:
    assert _gpipe_step(share) == pytest.approx(expected, rel=1e-12)


def test_inside_a_node_or_beside_a_spare_core_it_pays_nothing() -> None:
    assert _gpipe_step(1.0, nodes=1) == pytest.approx(6.0, rel=1e-12)
    assert _gpipe_step(1.0, cores=2.0) == pytest.approx(6.0, rel=1e-12)


def test_the_calibration_keeps_it_and_refuses_a_share_outside_0_1() -> None:
    cal = Calibration(inter=Link(1e-4, 1.2e7), link_cpu=0.4, nodes=2)
    assert Calibration.from_json(cal.to_json()) == cal
    assert Calibration.from_dict({}).link_cpu == 0.0  # (a calibration saved before it existed)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"link_cpu is a share of a core, in \[0, 1\]"):
            Calibration(link_cpu=bad)
