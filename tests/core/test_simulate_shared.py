"""The shared-core replay against the simulator (cores enough) and closed forms (cores short)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from stagewise.passes import add_grad_sync
from stagewise.schedules import generate, schedule_info, schedule_names
from stagewise.simulation import CostModel, shared_makespan, simulate

SYNC_SCHEDULES = [n for n in schedule_names() if schedule_info(n).synchronous]


def _random_costs(n: int, rng: random.Random, zeros: bool = False) -> CostModel:
    def draw() -> list[float]:
        return [rng.uniform(0.25, 2.0) for _ in range(n)]

    def work() -> list[float]:  # with ``zeros``, a third of the actions cost nothing (a ReLU-only stage's I)
        return [0.0 if zeros and rng.random() < 1 / 3 else x for x in draw()]

    return CostModel(
        num_stages=n,
        forward=work(),
        backward_input=work(),
        backward_weight=work(),
        activation_bytes=[1.0] * n,
        weight_activation_bytes=[0.0] * n,
        parameter_bytes=[1.0] * n,
        output_bytes=draw(),
        latency=0.1,
        bandwidth=4.0,
        sync_time=draw(),
        backward_full=draw(),  # B as measured, not I + W: a B action is charged its own time
    )


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("name", SYNC_SCHEDULES)
def test_with_a_core_per_process_it_is_the_simulator(name: str, zeros: bool) -> None:
    """Also with actions that cost nothing: one that finishes at once hands on its message in the same instant,
    to a rank the sweep had already passed (the replay stopped there, 'cannot finish', before)."""
    rng = random.Random(f"{name} {zeros}")
    checked = 0
    for p in (2, 3, 4):
        for m in (1, 2, 5, 8):
            try:
                schedule = add_grad_sync(generate(name, p, m, None))
            except ValueError:
                continue  # a size this schedule does not take
            costs = _random_costs(schedule.num_stages, rng, zeros)
            ones = [1.0] * p
            dedicated = simulate(schedule, costs).makespan
            assert shared_makespan(schedule, costs, ones, p) == pytest.approx(dedicated, rel=1e-12)
            # a SYNC's CPU share takes a core: with a core each, the SYNC takes its own time as a wait does
            for cpu in (0.5, 1.0):
                on_cores = replace(costs, sync_cpu=cpu)
                assert shared_makespan(schedule, on_cores, ones, p) == pytest.approx(dedicated, rel=1e-12)
            # replicas (weights 2) send a copy each over a shared link; on an unbounded one they cost nothing more
            weights = [rng.choice([1.0, 2.0]) for _ in range(p)]
            free = replace(costs, bandwidth=math.inf)
            dedicated = simulate(schedule, free).makespan
            assert shared_makespan(schedule, free, weights, sum(weights)) == pytest.approx(dedicated, rel=1e-12)
            # each rank on a node of its own, with the cores its replicas need
            nodes = list(range(p))
            assert shared_makespan(schedule, free, weights, max(weights), nodes) == pytest.approx(dedicated, rel=1e-12)
            checked += 1
    assert checked > 0


def test_one_core_runs_every_process_one_after_another() -> None:
    """GPipe never leaves every rank waiting once started, so on one core the step is all the work: 4 x 8 x 3."""
    schedule = generate("gpipe", 4, 8, None)
    costs = CostModel.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0)
    assert simulate(schedule, costs).makespan == pytest.approx(33.0)
    assert shared_makespan(schedule, costs, [1.0] * 4, 1.0) == pytest.approx(96.0, rel=1e-12)
    # two replicas per rank on two cores: the same share of a core each
    assert shared_makespan(schedule, costs, [2.0] * 4, 2.0) == pytest.approx(96.0, rel=1e-12)


def test_a_lone_rank_gets_a_whole_core_and_no_more() -> None:
    """One micro-batch through 2 stages: only one rank computes at a time. On 1 core each action takes its own time
    (the step is the dedicated one); with 2 replicas per rank on that core, twice as long; the transfer is no work."""
    schedule = generate("gpipe", 2, 1, None)
    costs = CostModel.uniform(2, forward=1.0, backward_input=0.5, backward_weight=0.5, comm_time=0.25)
    dedicated = simulate(schedule, costs).makespan
    assert dedicated == pytest.approx(4 * 1.0 + 2 * 0.25)
    assert shared_makespan(schedule, costs, [1.0, 1.0], 1.0) == pytest.approx(dedicated, rel=1e-12)
    assert shared_makespan(schedule, costs, [2.0, 2.0], 1.0) == pytest.approx(2 * 4.0 + 2 * 0.25, rel=1e-12)


def test_two_ranks_overlapping_share_the_core_in_the_overlap() -> None:
    """GPipe, 2 stages, 2 micro-batches, F = B = 1 on one core: F0 0-1 alone; then 0F1 and 1F0 together at half
    speed (1-3); 1F1 alone (3-4); 1B0 and 1B1 alone (4-6); 0B0 and 0B1 alone (6-8)... on one core every phase is
    all the work (2 x 2 x 2 = 8); on 1.5 cores the overlap runs at 0.75 each."""
    schedule = generate("gpipe", 2, 2, None)
    costs = CostModel.uniform(2, forward=1.0, backward_input=0.5, backward_weight=0.5)
    assert shared_makespan(schedule, costs, [1.0, 1.0], 1.0) == pytest.approx(8.0, rel=1e-12)
    # dedicated: 0F0 0-1, 0F1 1-2 || 1F0 1-2, 1F1 2-3, 1B0 3-4, 1B1 4-5 || 0B0 4-5, 0B1 5-6 -> 6
    assert simulate(schedule, costs).makespan == pytest.approx(6.0)
    # 1.5 cores: both overlaps (0F1 || 1F0 and 1B1 || 0B0) take 1 / 0.75 instead of 1
    assert shared_makespan(schedule, costs, [1.0, 1.0], 1.5) == pytest.approx(6.0 + 2 * (1 / 0.75 - 1), rel=1e-12)


def test_a_sync_s_cpu_share_shares_the_cores_its_wait_does_not() -> None:
    """GPipe, 2 stages, 1 micro-batch, F = B = 1 and a SYNC of 2 on each stage. 0F0 0-1, 1F0 1-2, 1B0 2-3; then
    rank 1's SYNC beside rank 0's B on one core.
    - A wait (``sync_cpu`` 0): 0B0 3-4 alone on the core, 0SYNC 4-6: 6.
    - All CPU (1): from 3 both at half speed, 0B0 ends at 5 with 1 of 1SYNC's 2 done, which ends at 7, and
      0SYNC's last second runs alone to 8: all the work on one core.
    - Half (0.5): the SYNC counts as half a process, so the core goes 2/3 to each; 0B0 ends at 4.5, 1SYNC having
      advanced at 1 / (0.5 + 0.5 x 1.5) = 0.8 (1.2 done); then two half-processes fill the core, both at 1: 1SYNC
      ends at 5.3, 0SYNC (0.8 of 2 done by then) at 6.5.
    With a core each, all read 6."""
    schedule = add_grad_sync(generate("gpipe", 2, 1, None))
    waits = replace(CostModel.uniform(2, forward=1.0, backward_input=0.5, backward_weight=0.5), sync_time=(2.0, 2.0))
    assert simulate(schedule, waits).makespan == pytest.approx(6.0)
    for cpu, one_core in ((0.0, 6.0), (1.0, 8.0), (0.5, 6.5)):
        costs = replace(waits, sync_cpu=cpu)
        assert shared_makespan(schedule, costs, [1.0, 1.0], 1.0) == pytest.approx(one_core, rel=1e-12)
        assert shared_makespan(schedule, costs, [1.0, 1.0], 2.0) == pytest.approx(6.0, rel=1e-12)
    with pytest.raises(ValueError, match="sync_cpu is a share of a SYNC's time, in \\[0, 1\\], got 1.5"):
        replace(waits, sync_cpu=1.5)


def test_bad_input_is_named() -> None:
    schedule = generate("gpipe", 2, 2, None)
    costs = CostModel.uniform(2)
    with pytest.raises(ValueError, match="one weight > 0 per rank"):
        shared_makespan(schedule, costs, [1.0], 1.0)
    with pytest.raises(ValueError, match="cores must be > 0"):
        shared_makespan(schedule, costs, [1.0, 1.0], 0.0)
    with pytest.raises(ValueError, match="cost model describes 3 stages"):
        shared_makespan(schedule, CostModel.uniform(3), [1.0, 1.0], 1.0)
