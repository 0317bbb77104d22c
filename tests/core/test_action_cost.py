"""What a compute action costs beyond its layers' linear share (issue 49, 4 processes on 2 cores): the
per-action overhead on shared cores and the layers at a plan's own micro-batch, against hand-computed steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule
from stagewise.ir import Action, Event, Kind, Timeline
from stagewise.planning.action_cost import at_batch, fit_overhead, with_overhead
from stagewise.planning.recalibrate import calibrate_run, held_out_costs
from stagewise.simulation import CostModel, shared_makespan

F, B = Kind.F, Kind.B


def one_rank_costs() -> CostModel:
    return CostModel.uniform(1, forward=1.0, backward_input=1.0, backward_weight=1.0, backward_full=2.0)


def test_an_overhead_per_action_is_work_on_the_shared_cores() -> None:
    """One rank standing for 2 processes on 1 core (each at half speed), 2 micro-batches of F 1 s and B 2 s,
    0.5 s per action: 2 x (1.5 + 1.5 + 2.5 + 2.5) = 16 s; without the overhead 12 s; alone on 2 cores 8 s."""
    schedule = build_schedule("gpipe", 1, 2)
    costs = one_rank_costs()
    assert shared_makespan(schedule, costs, [2.0], 1.0) == 12.0
    assert shared_makespan(schedule, with_overhead(costs, 0.5), [2.0], 1.0) == 16.0
    assert shared_makespan(schedule, with_overhead(costs, 0.5), [2.0], 2.0) == 8.0
    assert with_overhead(costs, 0.0) is costs
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        with_overhead(costs, -1.0)


def test_the_overhead_that_makes_the_replay_take_the_measured_step() -> None:
    """The replay above is 12 + 8 o: a measured 16 s gives o = 0.5; a model already at 12 s for a 10 s step
    gives 0 (the bias carries the rest)."""
    schedule, costs = build_schedule("gpipe", 1, 2), one_rank_costs()

    def replay(o: float) -> float:
        return shared_makespan(schedule, with_overhead(costs, o), [2.0], 1.0)

    assert fit_overhead(replay, 16.0) == pytest.approx(0.5, rel=1e-6)
    assert fit_overhead(replay, 10.0) == 0.0


def gapped_run() -> Timeline:
    """One rank, one stage of two layers: F 1 s, B 2 s per micro-batch, each action 0.5 s after the last
    ended (the interpreter's time between actions, in no compute event): a step of 7.5 s for 6 s of compute.

    rank 0: F0 [0, 1]  F1 [1.5, 2.5]  B0 [3, 5]  B1 [5.5, 7.5]
    """
    rows = [(F, 0, 0.0, 1.0), (F, 1, 1.5, 2.5), (B, 0, 3.0, 5.0), (B, 1, 5.5, 7.5)]
    return Timeline("gpipe", 1, [Event(0, Action(0, k, m), t0, t1) for k, m, t0, t1 in rows], source="measured")


def test_calibrated_per_action_a_plan_with_twice_the_actions_pays_twice() -> None:
    """The run above, calibrated per action: 6 + 4 o = 7.5, o = 0.375 s, bias 1. A plan Q of the same work in
    twice the actions (1F1B on 2 ranks, a layer each, on the 1 core: the core never idles, so the step is the
    work: 2 x 2 x (0.5 + 1) + 8 x 0.375 = 9 s) is predicted 9 s; the bias alone (1.25 x 6 s) said 7.5 s."""
    prior = fake_profile([1.0, 1.0])  # two layers, each F 0.5, B 1 at this micro-batch
    prior = replace(prior, layers=tuple(replace(x, forward=0.5, backward=1.0) for x in prior.layers))
    one = build_schedule("gpipe", 1, 2)
    per_action = calibrate_run([gapped_run()], one, prior, [2], cores=1.0, per_action=True)
    assert per_action.overhead == pytest.approx(0.375, rel=1e-6) and per_action.bias == pytest.approx(1.0)
    biased = calibrate_run([gapped_run()], one, prior, [2], cores=1.0)
    assert biased.overhead == 0.0 and biased.bias == 1.25
    q = build_schedule("1f1b", 2, 2)
    costs = held_out_costs(per_action, prior, [1, 1])
    assert per_action.predict(q, costs, processes_per_node=2).step == pytest.approx(9.0, rel=1e-6)
    assert biased.predict(q, held_out_costs(biased, prior, [1, 1]), processes_per_node=2).step == 7.5


def test_the_layers_at_the_plans_own_micro_batch_keep_the_calibrated_ratio() -> None:
    """A layer profiled at F 2 s (the calibrating micro-batch) ran 3 s in the run (ratio 1.5); profiled at
    twice the micro-batch it takes 3 s, not 4 (a fixed part per call): Q's stage is 4.5 s, where the linear
    scaling said 2 x 3 = 6 s."""
    prior = fake_profile([1.0])
    prior = replace(prior, layers=(replace(prior.layers[0], forward=2.0, backward=4.0),))
    doubled = replace(prior, layers=(replace(prior.layers[0], forward=3.0, backward=6.0),))
    run = Timeline("gpipe", 1, [Event(0, Action(0, F, 0), 0.0, 3.0), Event(0, Action(0, B, 0), 3.0, 9.0)])
    cal = calibrate_run([run], build_schedule("gpipe", 1, 1), prior, [1], cores=1.0)
    assert cal.profile(prior).layers[0].forward == 3.0
    assert at_batch(cal.profile(prior), prior, doubled).layers[0].forward == 4.5
    assert held_out_costs(cal, prior, [1], at=doubled).forward == (4.5,)
    assert held_out_costs(cal, prior, [1], batch_ratio=2.0).forward == (6.0,)
    with pytest.raises(ValueError, match="same layers"):
        at_batch(prior, prior, fake_profile([1.0, 1.0]))
