"""What a compute action costs beyond its layers' linear share (issue 49, 4 processes on 2 cores): the
per-action overhead on shared cores and the layers at a plan's own micro-batch, against hand-computed steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule
from stagewise.ir import Action, Event, Kind, Timeline
from stagewise.planning.action_cost import Overheads, action_overhead, at_batch, with_overhead
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
    with pytest.raises(ValueError, match="must be >= 0"):
        with_overhead(costs, -1.0)
    with pytest.raises(ValueError, match="needs the placement"):
        with_overhead(costs, 0.5, 0.25)


def test_each_message_is_charged_to_the_action_that_posts_it() -> None:
    """Four stages of F 1, I 1, W 1 (B 2) on two ranks, 0.5 s an action and 0.25 s a message. Interleaved
    (stages on ranks 0 1 0 1) crosses ranks at every boundary: the inner stages' F and B post two messages each
    (one received, one sent), the outer ones one. ZB-V (0 1 1 0) keeps the boundary between stages 1 and 2 on
    rank 1: every stage's F and B post one. A W posts none."""
    costs = CostModel.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0, backward_full=2.0)
    interleaved = with_overhead(costs, 0.5, 0.25, [0, 1, 0, 1])
    assert interleaved.forward == (1.75, 2.0, 2.0, 1.75)
    assert interleaved.backward_full == (2.75, 3.0, 3.0, 2.75)
    assert interleaved.backward_input == (1.75, 2.0, 2.0, 1.75)
    assert interleaved.backward_weight == (1.5,) * 4
    v = with_overhead(costs, 0.5, 0.25, [0, 1, 1, 0])
    assert v.forward == (1.75,) * 4 and v.backward_full == (2.75,) * 4 and v.backward_weight == (1.5,) * 4
    assert with_overhead(costs, 0.5, 0.25, [0, 0, 0, 0]) == with_overhead(costs, 0.5)  # one rank: no message
    with pytest.raises(ValueError, match="one rank per stage"):
        with_overhead(costs, 0.5, 0.25, [0, 1])


def two_rank_run() -> Timeline:
    """1F1B on 2 ranks, 2 micro-batches, with time outside the compute events (1 s of F, 2 s of B):

    rank 0: F0 [0, 1] SEND_F0 [1, 1.25]  F1 [2, 3]          B0 [4, 6]           B1 [7.5, 9.5]
    rank 1:           F0 [1, 2]  B0 [2, 4]        F1 [4.5, 5.5]  B1 [5.5, 7.5]

    Counted: rank 0's posting [1, 1.25] and gap [1.25, 2] before F1 (no input to wait for), while rank 1
    computes F0; rank 1's gap [4, 4.5] before F1 (its input was sent at 3), while rank 0 computes B0; rank 1's
    B0 and B1 (gaps of 0). Left out: each rank's first action, and rank 0's B0 and B1 (their inputs came after
    its previous event ended: the gap holds a wait)."""
    rows = [
        (0, 0, F, 0, 0.0, 1.0), (0, 0, Kind.SEND_F, 0, 1.0, 1.25), (0, 0, F, 1, 2.0, 3.0), (0, 0, B, 0, 4.0, 6.0),
        (0, 0, B, 1, 7.5, 9.5), (1, 1, F, 0, 1.0, 2.0), (1, 1, B, 0, 2.0, 4.0), (1, 1, F, 1, 4.5, 5.5),
        (1, 1, B, 1, 5.5, 7.5),
    ]  # fmt: skip
    events = [Event(r, Action(s, k, m), t0, t1) for r, s, k, m, t0, t1 in rows]
    return Timeline("1f1b", 2, events, source="measured")


def test_the_overhead_is_the_time_outside_compute_not_waiting_on_a_core_of_its_own() -> None:
    """On 2 cores each rank has a core: the gaps (0.75 + 0.5 + 0 + 0) / 4 actions counted, 0.3125 s an action;
    the posting 0.25 s over the one message posted. On 1 core the counted time ran while the other rank
    computed, at half speed: 0.15625 and 0.125 s. Over steps, the median step's."""
    schedule = build_schedule("1f1b", 2, 2)
    assert action_overhead([two_rank_run()], schedule, cores=2.0) == Overheads(0.3125, 0.25)
    assert action_overhead([two_rank_run()], schedule, cores=1.0) == Overheads(0.15625, 0.125)
    assert action_overhead([], schedule, cores=1.0) == Overheads(0.0, 0.0)
    run = two_rank_run()  # the same step with every time 3x (a step a neighbour preempted): the median of steps
    stretched = replace(run, events=[replace(e, start=3 * e.start, end=3 * e.end) for e in run.events])
    assert action_overhead([run, stretched, run], schedule, cores=2.0) == Overheads(0.3125, 0.25)


def gapped_run() -> Timeline:
    """One rank, one stage of two layers: F 1 s, B 2 s per micro-batch, each action 0.5 s after the last
    ended (the interpreter's time between actions, in no compute event): a step of 7.5 s for 6 s of compute.

    rank 0: F0 [0, 1]  F1 [1.5, 2.5]  B0 [3, 5]  B1 [5.5, 7.5]
    """
    rows = [(F, 0, 0.0, 1.0), (F, 1, 1.5, 2.5), (B, 0, 3.0, 5.0), (B, 1, 5.5, 7.5)]
    return Timeline("gpipe", 1, [Event(0, Action(0, k, m), t0, t1) for k, m, t0, t1 in rows], source="measured")


def test_calibrated_per_action_a_plan_with_twice_the_actions_pays_twice() -> None:
    """The run above, calibrated per action: 3 gaps of 0.5 s over 3 actions, o = 0.5 s; the model of the run,
    6 + 4 o = 8 s, against 7.5 measured: bias 15/16. A plan Q of the same work in twice the actions (1F1B on 2
    ranks, a layer each, on the 1 core: the core never idles, so the step is the work: 2 x 2 x (0.5 + 1) +
    8 x 0.5 = 10 s) is predicted 10 x 15/16 = 9.375 s; the bias alone (1.25 x 6 s) said 7.5 s."""
    prior = fake_profile([1.0, 1.0])  # two layers, each F 0.5, B 1 at this micro-batch
    prior = replace(prior, layers=tuple(replace(x, forward=0.5, backward=1.0) for x in prior.layers))
    one = build_schedule("gpipe", 1, 2)
    per_action = calibrate_run([gapped_run()], one, prior, [2], cores=1.0, per_action=True)
    assert per_action.overhead == 0.5 and per_action.bias == 0.9375
    biased = calibrate_run([gapped_run()], one, prior, [2], cores=1.0)
    assert biased.overhead == 0.0 and biased.bias == 1.25
    q = build_schedule("1f1b", 2, 2)
    costs = held_out_costs(per_action, prior, [1, 1])
    assert per_action.predict(q, costs, processes_per_node=2).step == 9.375
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
    # the split backward at twice the micro-batch: the run's B of 6 s split as the prior splits it (I and W
    # half each: 3 s), times the whole model's backward ratio at twice the micro-batch (6 / 4)
    assert at_batch(cal.profile(prior), prior, doubled).layers[0].backward_input == pytest.approx(4.5)
    with pytest.raises(ValueError, match="same layers"):
        at_batch(prior, prior, fake_profile([1.0, 1.0]))


def test_the_micro_batch_moves_the_run_s_layers_by_the_whole_model_s_ratio() -> None:
    """Two layers the run measured at F 1 and 3 s (the prior said 1 and 1); profiled at the plan's micro-batch
    they take 1.5 and 2.5 s (F 4 s against the prior's 2: 2x over the model): the run's layers doubled, 2 and
    6 s, not each layer by its own ratio (1.5 and 7.5 s). B alike: prior 2 + 2, at 5 + 3 (2x): 2 x the run's."""
    prior = fake_profile([3.0, 3.0])  # F 1, B 2 a layer
    at = replace(prior, layers=(replace(prior.layers[0], forward=1.5, backward=5.0),
                                replace(prior.layers[1], forward=2.5, backward=3.0)))  # fmt: skip
    run = replace(prior, layers=(replace(prior.layers[0], forward=1.0, backward=2.0),
                                 replace(prior.layers[1], forward=3.0, backward=4.0)))  # fmt: skip
    got = at_batch(run, prior, at).layers
    assert [x.forward for x in got] == [2.0, 6.0] and [x.backward for x in got] == [4.0, 8.0]
    assert [x.backward_input for x in got] == [2.0, 2.0]  # the run kept the prior's I of 1 s: 2x
