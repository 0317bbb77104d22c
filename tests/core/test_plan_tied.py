"""The planner prices the gradient sum of layers tied across stages (``LayerProfile.tied``: a token embedding and the
head reusing it), as the run's calibration does since issue 49 (tests/core/test_tied_sum.py): each candidate waits
for a ring over the ranks holding the tied layers, on the link between machines where those ranks span machines.

Before, a profile did not say which layers were tied, and ``sw.plan`` on two machines ranked every plan that ties
its first and last stage across them as if the sum were free: the ordering the calibration benchmark measured
backwards (ZB-V's V holds both uses on one rank and sums nothing). Hand-computed times, no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise.parallel import ParallelConfig
from stagewise.partition import LayerProfile
from stagewise.planning import Link, Plan, search
from stagewise.planning.candidate import tied_costs
from stagewise.planning.inputs import make_problem
from stagewise.planning.layouts import layout_of
from stagewise.planning.orders import placement_of
from stagewise.planning.tied_sum import TiedSum

#: 4 layers of F 1 s, I 1 s, W 1 s (B 2 s), one byte out each; the first (the embedding) holds 2048 bytes, the last
#: reuses them (holds none)
UNTIED = fake_profile([3.0] * 4, params=[2048.0, 0.0, 0.0, 0.0])
TIED = replace(UNTIED, tied=(((0, 3), 2048.0),))
INTER, INTRA = Link(4.0, 1024.0), Link(0.5, 4096.0)  # between the machines; inside one
TWO_MACHINES = dict(nodes=2, inter=INTER, intra=INTRA, recompute=[None], top=20)
SUM = 2 * (2 * 4.0 + 2048 / (2 * 1024))  # 2 ranks: 2 ring steps, each a notice and a message: 18 s


def _plans(profile: LayerProfile, **options: object) -> dict[tuple[str, tuple[int, ...]], Plan]:
    kw = {**TWO_MACHINES, **options}
    return {(p.describe(), p.partition): p for p in search(profile, 2, **kw).plans}  # type: ignore[arg-type]


def test_the_tied_sum_flips_the_plan_on_two_machines() -> None:
    """2 processes on 2 machines, 1 micro-batch (the only layout: pp=2). 1F1B cut 2 + 2: F 2 s and B 4 s a stage,
    one crossing each way of 4 + 1/1024 s (a byte at 1024 B/s): 12 + 2 x 4.0009765625 = 20.001953125 s. ZB-V cut
    1 x 4: F 1 and I 1 a stage in a chain that crosses the machines 4 times, then stage 0's W: 9 + 4 x 4.0009765625
    = 25.00390625 s. Without the tied set that is the old answer, 1F1B first. With it, 1F1B's embedding and head sit
    on the two machines: a 2-rank ring of 2048 bytes, 2 (2 x 4 + 2048 / 2048) = 18 s, starting at stage 0's SYNC (its
    last action): 38.001953125 s; ZB-V holds both on rank 0 and sums nothing: it goes first."""
    options = dict(global_batch=1, schedules=["1f1b", "zb-v"])
    before = search(UNTIED, 2, **TWO_MACHINES, **options).plans  # type: ignore[arg-type]
    assert [(p.schedule, p.step_time) for p in before] == [("1f1b", 20.001953125), ("zb-v", 25.00390625)]
    after = search(TIED, 2, **TWO_MACHINES, **options).plans  # type: ignore[arg-type]
    assert [(p.schedule, p.step_time) for p in after] == [("zb-v", 25.00390625), ("1f1b", 20.001953125 + SUM)]
    assert [p.breakdown["grad_sync"] for p in after] == [0.0, SUM]


@pytest.mark.parametrize(
    "options",
    [
        dict(global_batch=2, schedules=["1f1b", "zb-v"]),  # the simulator's step (pp=2 and pp=1 x dp=2)
        dict(global_batch=1, schedules=["1f1b", "zb-v"], cores=0.5),  # the replay on shared cores
        dict(global_batch=4, schedules=["1f1b", "auto"]),  # a schedule synthesized for the plan
    ],
    ids=["simulated", "shared-cores", "auto"],
)
def test_every_way_of_predicting_a_step_waits_for_the_sum(options: dict[str, object]) -> None:
    """Each 1F1B-placed plan (its own schedule, or one synthesized for it) pays the 18 s exactly, whether the step is
    the simulator's or the replay on half a core; ZB-V pays nothing, nor does pp=1 x dp=2 (both uses on one rank: its
    replicas' 10 s ring takes the place of the stage's own all-reduce of the same bytes, which leaves them out)."""
    before, after = _plans(UNTIED, **options), _plans(TIED, **options)
    assert sorted(before) == sorted(after)
    for key, plan in after.items():
        paid = SUM if plan.layout.pp == 2 and plan.schedule != "zb-v" else 0.0
        assert plan.step_time == before[key].step_time + paid, key
    assert any(p.schedule == "auto" for p in after.values()) == ("auto" in options["schedules"])  # type: ignore[operator]


def test_each_layout_prices_the_ring_on_its_own_links() -> None:
    """1F1B on 2 ranks of 2 processes each (pp=2 x dp=2), a machine per pipeline rank: a ring of 4 over the machines,
    2 (4 - 1) (2 x 4 + 2048 / (4 x 1024)) = 51 s. ZB-V there: one rank holds both uses, its 2 replicas share a
    machine: 2 (2 - 1) (0.5 + 2048 / (2 x 4096)) = 1.5 s. pp=2 on one machine: the ring inside it,
    2 (2 x 0.5 + 2048 / (2 x 4096)) = 2.5 s. No tied set: nothing."""

    def sums(processes: int, nodes: int, dp: int, schedule: str, v: int, bounds: list[int]) -> tuple[TiedSum, ...]:
        prob = make_problem(TIED, processes, global_batch=4, nodes=nodes, inter=INTER, intra=INTRA)
        layout = layout_of(prob, ParallelConfig(pp=2, dp=dp))
        return tied_costs(layout, placement_of(schedule, 2, v), bounds, TIED.tied)

    assert sums(4, 2, 2, "1f1b", 1, [0, 2, 4]) == (TiedSum((0, 1), 51.0),)
    assert sums(4, 2, 2, "zb-v", 2, [0, 1, 2, 3, 4]) == (TiedSum((0, 3), 1.5),)
    assert sums(2, 1, 1, "1f1b", 1, [0, 2, 4]) == (TiedSum((0, 1), 2.5),)
    assert sums(2, 2, 1, "zb-v", 2, [0, 1, 2, 3, 4]) == ()
    layout = layout_of(make_problem(UNTIED, 2, global_batch=1, nodes=2), ParallelConfig(pp=2))
    assert tied_costs(layout, [0, 1], [0, 2, 4], UNTIED.tied) == ()


def test_the_tied_sets_survive_json_and_are_checked() -> None:
    """What ``stagewise.plan`` sends every rank of a job (the profile's JSON) keeps the sets; a profile without any
    writes the JSON it always wrote. A set names at least two distinct layers of the profile and finite bytes."""
    again = LayerProfile.from_json(TIED.to_json())
    assert again == TIED and again.tied == (((0, 3), 2048.0),)
    assert "tied" not in UNTIED.to_json() and LayerProfile.from_json(UNTIED.to_json()).tied == ()
    assert replace(UNTIED, tied=[[[3, 0], 8]]).tied == (((0, 3), 8.0),)  # as tuples, layers ascending
    for bad in ([[[0], 8.0]], [[[0, 4], 8.0]], [[[1, 1], 8.0]], [[[0, 3], -1.0]], [[[0, 3], float("inf")]], [[0, 3]]):
        with pytest.raises(ValueError, match="LayerProfile.tied: each set is"):
            replace(UNTIED, tied=bad)
    with pytest.raises(ValueError, match="LayerProfile.tied: each set is"):
        replace(TIED, layers=TIED.layers[:3])  # fewer layers: the set no longer fits
    with pytest.raises(ValueError, match="'tied' must be a list of"):
        LayerProfile.from_json(TIED.to_json().replace('"bytes"', '"size"'))
