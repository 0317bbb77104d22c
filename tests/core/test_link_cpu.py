"""A message between machines takes CPU at both ends while it is on the link (``CostModel.link_cpu``, issue 49).

Over 100 Mbit/s between two namespace machines the compute of 1F1B, GPipe, interleaved 1F1B and ZB-V (8
micro-batches, 2 ranks) ran 26, 36, 41 and 57 % slower than over the veth, and interleaved 1F1B, three times
1F1B's messages, was predicted 19 % low (2026-12-06). The shared-core replay now counts a message on the link
as ``link_cpu`` of a process on its sender's node and on its receiver's. Checked by hand on GPipe, 2 ranks,
2 micro-batches, F 1 s, B 0 s, each message 1 s on the link, each rank a node of one core.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from stagewise import build_schedule
from stagewise.planning.recalibrate import RunCalibration
from stagewise.simulation import CostModel, shared_makespan, simulate


def _gpipe(link_cpu: float, rank_nodes: tuple[int, ...] = ()) -> CostModel:
    return CostModel(
        num_stages=2, forward=[1.0, 1.0], backward_input=[0.0, 0.0], backward_weight=[0.0, 0.0],
        activation_bytes=[1.0, 1.0], weight_activation_bytes=[0.0, 0.0], parameter_bytes=[1.0, 1.0],
        output_bytes=[1.0, 1.0], latency=0.0, bandwidth=1.0, link_cpu=link_cpu, rank_nodes=rank_nodes,
        local_latency=0.0, local_bandwidth=1.0,
    )  # fmt: skip


def _step(costs: CostModel) -> float:
    return shared_makespan(build_schedule("gpipe", 2, 2), costs, [1.0, 1.0], 1.0, nodes=[0, 1])


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        # F0(0) [0, 1]; its message on the link [1, 2] while F0(1) computes beside it at 1 / (1 + f); F1(0) from 2,
        # beside F0(1)'s message once that leaves; the two gradients queue on rank 1's link after F1(1)
        (0.0, 6.0),  # F0(1) [1, 2], message [2, 3], F1(0) [2, 3], F1(1) [3, 4], gradients [4, 5] and [5, 6]
        (0.5, 19 / 3),  # F0(1) ends 2 + 1/3; F1(0): 1/3 by then, 2/3 at 2/3 -> 10/3; F1(1) to 13/3; + 2
        (1.0, 6.5),  # F0(1) ends 2.5; F1(0): 0.5 by 2.5, 0.5 at 1/2 -> 3.5; F1(1) to 4.5; + 2
    ],
)
def test_a_message_on_the_link_slows_the_compute_at_both_ends(share: float, expected: float) -> None:
    assert _step(_gpipe(share)) == pytest.approx(expected, rel=1e-12)


def test_it_takes_only_what_the_cores_leave() -> None:
    """With a core to spare on each node (2 cores, one process) the messages' CPU slows nothing."""
    costs = _gpipe(1.0)
    assert shared_makespan(build_schedule("gpipe", 2, 2), costs, [1.0, 1.0], 2.0, nodes=[0, 1]) == pytest.approx(6.0)


def test_a_message_inside_a_machine_takes_none() -> None:
    """Inside one machine a message is the sender's copy, not a link's trickle: the share does not apply."""
    inside = _gpipe(1.0, rank_nodes=(0, 0))
    assert _step(inside) == pytest.approx(_step(replace(inside, link_cpu=0.0)))


def test_the_simulator_with_a_device_per_rank_ignores_it() -> None:
    """``simulate`` gives each rank a device of its own (a GPU's copy engines): the share is the replay's only."""
    schedule = build_schedule("gpipe", 2, 2)
    assert simulate(schedule, _gpipe(1.0)).makespan == pytest.approx(simulate(schedule, _gpipe(0.0)).makespan)


def test_the_share_is_checked_and_kept_through_json() -> None:
    with pytest.raises(ValueError, match="link_cpu is a share of a core"):
        _gpipe(1.5)
    costs = replace(_gpipe(0.25, rank_nodes=(0, 1)), sync_cpu=0.5)
    assert CostModel.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs  # (sync_cpu was dropped before)


def test_the_calibration_prices_its_plans_with_its_probed_share() -> None:
    """:meth:`RunCalibration.linked` puts the probed share on every plan it predicts, P's own too."""
    run = RunCalibration(counts=(1, 1), measured={}, latency=0.0, bandwidth=1.0, cores=1.0, steps=(1.0,),
                         link_cpu=0.5)  # fmt: skip
    assert run.linked(_gpipe(0.0)).link_cpu == 0.5
    assert run.linked(_gpipe(0.0), nodes=[0, 1]).link_cpu == 0.5
