"""The simulator against closed forms, transfers, SYNC/STEP costs and activation memory."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise.ir import Action, Kind, Schedule, consumes, loop_placement, produces
from stagewise.simulation import CostModel, simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8, 13)]
#: (F, I, W) triples that add exactly in binary floating point
TIMES = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.5, 0.75, 0.25), (3.0, 1.0, 2.0)]


def uniform(n: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, **kw: float) -> CostModel:
    return CostModel.uniform(n, forward=f, backward_input=i, backward_weight=w, **kw)


# ---- closed forms -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("f,i,w", TIMES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str, f: float, i: float, w: float) -> None:
    for p, m in GRID:
        for schedule in (sw.schedules.generate(name, p, m), sw.build_schedule(name, p, m)):
            result = simulate(schedule, uniform(p, f, i, w))
            assert result.makespan == (m + p - 1) * (f + i + w), (name, p, m)
            assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_peak_activations_1f1b_min_p_m_gpipe_m(p: int, m: int) -> None:
    one_f = simulate(sw.schedules.generate("1f1b", p, m))
    gpipe = simulate(sw.schedules.generate("gpipe", p, m))
    assert one_f.peak_activations[0] == min(p, m)
    assert one_f.peak_activations == [min(p - r, m) for r in range(p)]
    assert gpipe.peak_activations == [m] * p


def test_naive_runs_one_microbatch_at_a_time() -> None:
    for p, m in GRID:
        result = simulate(sw.schedules.generate("naive", p, m), uniform(p, 1.0, 2.0, 0.0))
        assert result.makespan == m * p * 3.0
        assert result.peak_activations == [1] * p


def test_result_matches_its_timeline() -> None:
    result = simulate(sw.build_schedule("1f1b", 4, 6), uniform(4, comm_time=0.25, sync_time=0.5))
    tl = result.timeline
    assert tl.source == "simulated" and tl.unit == "cost" and tl.num_ranks == 4
    assert result.makespan == tl.makespan
    assert result.bubble_ratio == pytest.approx(tl.bubble_ratio, abs=1e-12)
    assert len(tl.events) == sum(
        1 for acts in sw.build_schedule("1f1b", 4, 6).ranks for a in acts if not a.kind.is_comm
    )
    for row in tl.by_rank():
        assert all(a.end <= b.start for a, b in zip(row, row[1:])), "a rank runs one action at a time"


def test_interleaving_divides_the_bubble_by_v() -> None:
    """GPipe over v chunks per rank (loop placement): bubble time (p-1)(F+B)/v, with F, B per rank."""

    def gpipe_chunks(p: int, m: int, v: int) -> Schedule:
        ranks = []
        for r in range(p):
            acts = [Action(c * p + r, Kind.F, i) for c in range(v) for i in range(m)]
            acts += [Action(c * p + r, Kind.B, i) for c in reversed(range(v)) for i in range(m)]
            ranks.append(tuple(acts))
        return Schedule("gpipe-chunks", m, loop_placement(p, v), tuple(ranks))

    for p, m, v in [(2, 2, 2), (4, 4, 2), (4, 8, 4), (3, 5, 2)]:
        schedule = gpipe_chunks(p, m, v)  # compute-only: with blocking sends it would deadlock
        f, b = 1.0, 2.0  # per rank; each of the v stages on a rank takes 1/v of it
        result = simulate(schedule, uniform(p * v, f / v, b / v, 0.0))
        assert result.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
        assert result.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))
        assert result.peak_activations == [m] * p  # v chunks of m activations, 1/v each


# ---- transfers ----------------------------------------------------------------------


@pytest.mark.parametrize("f,i,w", TIMES)
@pytest.mark.parametrize("c", [0.25, 1.0, 8.0])
def test_gpipe_pays_each_link_once_each_way(f: float, i: float, w: float, c: float) -> None:
    for p, m in GRID:
        result = simulate(sw.build_schedule("gpipe", p, m), uniform(p, f, i, w, comm_time=c))
        assert result.makespan == pytest.approx((m + p - 1) * (f + i + w) + 2 * (p - 1) * c)


@pytest.mark.parametrize("c", [0.25, 1.0, 8.0])
def test_naive_pays_every_link_both_ways_for_each_microbatch(c: float) -> None:
    for p, m in GRID:
        result = simulate(sw.schedules.generate("naive", p, m), uniform(p, comm_time=c))
        assert result.makespan == pytest.approx(3 * p * m + 2 * (p - 1) * m * c)


@pytest.mark.parametrize("f,i,w", TIMES)
@pytest.mark.parametrize("c", [0.25, 1.0, 8.0])
def test_1f1b_comm_cost_closed_form(f: float, i: float, w: float, c: float) -> None:
    """1F1B with transfer time c: makespan = (m+p-1)(F+B) + 2c [(p-1) + floor((m-1)(p-1)/p)].

    The longest path is a zig-zag: micro-batch 0 crosses the p-1 links down and
    back up (2(p-1)c, as in GPipe). In the steady state, rank 0's next forward
    after B_k is F_{k+p}, so the cycle "rank 0 F -> ... -> rank p-1 F -> rank
    p-1 B -> ... -> rank 0 B -> rank 0 F" advances p micro-batches while it
    crosses 2(p-1) links; the other m-1 micro-batches each add 2c(p-1)/p,
    whole crossings only, hence the floor. Unlike GPipe, 1F1B cannot hide a
    transfer behind work it has not started.
    """
    for p in range(1, 9):
        for m in range(1, 25):
            result = simulate(sw.schedules.generate("1f1b", p, m), uniform(p, f, i, w, comm_time=c))
            hops = (p - 1) + (m - 1) * (p - 1) // p
            assert result.makespan == pytest.approx((m + p - 1) * (f + i + w) + 2 * c * hops), (p, m)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    costs = CostModel(
        num_stages=2,
        forward=(1.0, 1.0),
        backward_input=(2.0, 2.0),
        backward_weight=(0.0, 0.0),
        activation_bytes=(1.0, 1.0),
        weight_activation_bytes=(0.0, 0.0),
        parameter_bytes=(0.0, 0.0),
        output_bytes=(600.0, 50.0),  # stage 0's output (and its input gradient) is 600 bytes
        latency=0.5,
        bandwidth=200.0,
    )
    result = simulate(sw.build_schedule("gpipe", 2, 1), costs)
    link = 0.5 + 600 / 200
    assert result.makespan == pytest.approx(1 + link + 1 + 2 + link + 2)


def test_schedules_on_one_rank_pay_no_transfer() -> None:
    result = simulate(sw.schedules.generate("1f1b", 1, 4), uniform(1, comm_time=100.0))
    assert result.makespan == 12.0


def test_complete_and_compute_only_schedules_time_the_same() -> None:
    for name in sw.schedule_names():
        info = sw.schedule_info(name)
        v = info.default_virtual_stages
        for p, m in [(2, 4), (4, 8), (3, 6)]:
            try:
                compute = sw.schedules.generate(name, p, m, v)
            except ValueError:
                continue
            costs = uniform(compute.num_stages, 1.0, 1.0, 0.5, comm_time=0.3)
            complete = sw.build_schedule(name, p, m, v, grad_sync=False)
            assert simulate(compute, costs).makespan == pytest.approx(simulate(complete, costs).makespan), (name, p, m)


# ---- SYNC and STEP ------------------------------------------------------------------


def test_sync_time_is_paid_after_the_last_backward() -> None:
    p, m = 4, 8
    base = simulate(sw.build_schedule("gpipe", p, m)).makespan
    result = simulate(sw.build_schedule("gpipe", p, m), uniform(p, sync_time=2.5))
    assert result.makespan == base + 2.5  # rank 0 finishes last, then syncs
    syncs = [e for e in result.timeline.events if e.action.kind is Kind.SYNC]
    assert len(syncs) == p and all(e.duration == 2.5 for e in syncs)


def test_step_time_and_sync_count_as_idle_in_the_bubble() -> None:
    schedule = Schedule.from_csv("0F0,0B0,0F1,0B1,0SYNC,0STEP\n")
    costs = uniform(1, 1.0, 1.0, 1.0, sync_time=0.5, step_time=1.5)
    result = simulate(schedule, costs)
    assert result.makespan == 2 * 3.0 + 0.5 + 1.5
    assert result.bubble_ratio == pytest.approx(1 - 6.0 / 8.0)
    assert [str(e.action) for e in result.timeline.events][-2:] == ["0SYNC", "0STEP"]


@pytest.mark.parametrize("p,m", [(1, 1), (2, 5), (4, 8), (3, 13)])
def test_a_b_action_costs_the_measured_b_not_i_plus_w(p: int, m: int) -> None:
    """1F1B runs B: with B = 1.5 where I + W = 2.5 its step is (m + p - 1)(F + B); the same order with the
    backward split pays I + W on every rank, (p - 1)(F + I) + m(F + I + W) (exact in binary)."""
    costs = uniform(p, 1.0, 1.5, 1.0, backward_full=1.5)
    assert costs.backward(0) == 1.5 and costs.backward_times() == (1.5,) * p
    whole = simulate(sw.schedules.generate("1f1b", p, m), costs)
    split = simulate(sw.passes.lower(sw.schedules.generate("1f1b", p, m), split=True), costs)
    assert whole.makespan == (m + p - 1) * 2.5
    assert split.makespan == (p - 1) * 2.5 + m * 3.5
    busy = sum(e - s for starts, ends in zip(whole.starts, whole.ends) for s, e in zip(starts, ends))
    assert busy == p * m * 2.5  # every B charged 1.5, every F 1


def test_without_a_measured_b_it_costs_i_plus_w() -> None:
    plain = uniform(3, 1.0, 0.5, 0.75)
    assert plain.backward_full == () and plain.backward_times() == (1.25,) * 3
    assert plain.to_dict().get("backward_full") is None  # written only where given
    given = CostModel.from_dict({**plain.to_dict(), "backward_full": [1.0, 2.0, 0.5]})
    assert given.backward_full == (1.0, 2.0, 0.5) and given.backward(1) == 2.0
    assert CostModel.from_dict(json.loads(json.dumps(given.to_dict()))) == given
    schedule = sw.schedules.generate("gpipe", 3, 4)
    same = uniform(3, 1.0, 0.5, 0.75, backward_full=1.25)
    assert simulate(schedule, plain).makespan == simulate(schedule, same).makespan
    with pytest.raises(ValueError, match="backward_full has 2 entries"):
        CostModel.from_dict({**plain.to_dict(), "backward_full": [1.0, 2.0]})
    with pytest.raises(ValueError, match="backward_full must be finite"):
        uniform(2, backward_full=-1.0)


# ---- memory -------------------------------------------------------------------------


def test_w_keeps_its_part_of_the_activation_alive_after_i() -> None:
    costs = uniform(1, activation_bytes=10.0, weight_activation_bytes=4.0)
    deferred = simulate(Schedule.from_csv("0F0,0I0,0F1,0I1,0W0,0W1\n"), costs)
    # after I0 only W0's 4 bytes remain; F1 adds 10 -> 14 at its start
    assert deferred.peak_activation_bytes == [14.0]
    assert deferred.peak_activations == [1.0]
    assert deferred.memory == [[(0.0, 0.0), (0.0, 10.0), (2.0, 4.0), (2.0, 14.0), (4.0, 8.0), (5.0, 4.0), (6.0, 0.0)]]
    together = simulate(Schedule.from_csv("0F0,0B0,0F1,0B1\n"), costs)
    assert together.peak_activation_bytes == [10.0]
    assert together.memory[0][-1] == (6.0, 0.0)


def test_a_stash_larger_than_the_activation_grows_at_i() -> None:
    """W's stash holds the linear layers' inputs and output gradients: it can exceed what F saved (an MLP's
    stage), and then I ends with more bytes than it started with."""
    costs = uniform(1, activation_bytes=4.0, weight_activation_bytes=6.0)
    deferred = simulate(Schedule.from_csv("0F0,0I0,0F1,0I1,0W0,0W1\n"), costs)
    assert deferred.memory == [[(0.0, 0.0), (0.0, 4.0), (2.0, 6.0), (2.0, 10.0), (4.0, 12.0), (5.0, 6.0), (6.0, 0.0)]]
    assert deferred.peak_activation_bytes == [12.0]


def test_memory_timeline_of_gpipe_rises_to_m_then_drains() -> None:
    p, m = 3, 5
    result = simulate(sw.build_schedule("gpipe", p, m), uniform(p, activation_bytes=3.0))
    for rank, curve in enumerate(result.memory):
        values = [b for _, b in curve]
        times = [t for t, _ in curve]
        assert times == sorted(times)
        assert max(values) == 3.0 * m == result.peak_activation_bytes[rank]
        assert values[-1] == 0.0


def test_a_stash_larger_than_the_activations_grows_the_memory_at_i() -> None:
    """W's stash (a linear stack's inputs and output gradients) can outweigh what the forward saved: I then
    leaves more than F added, and the peak is taken after I."""
    costs = uniform(1, activation_bytes=4.0, weight_activation_bytes=6.0)
    result = simulate(Schedule.from_csv("0F0,0I0,0F1,0I1,0W0,0W1\n"), costs)
    assert result.memory == [[(0.0, 0.0), (0.0, 4.0), (2.0, 6.0), (2.0, 10.0), (4.0, 12.0), (5.0, 6.0), (6.0, 0.0)]]
    assert result.peak_activation_bytes == [12.0]


def test_split_backward_sends_the_gradient_before_w_and_frees_like_b() -> None:
    p, m = 4, 8
    costs = uniform(p, activation_bytes=8.0, weight_activation_bytes=2.0)
    split = simulate(sw.passes.lower(sw.schedules.generate("1f1b", p, m), split=True), costs)
    whole = simulate(sw.schedules.generate("1f1b", p, m), costs)
    # the previous rank waits for I only, so the fill is shorter: (p-1)(F+I) + m(F+I+W)
    assert whole.makespan == (m + p - 1) * 3.0
    assert split.makespan == (p - 1) * 2.0 + m * 3.0
    assert split.peak_activations == whole.peak_activations
    assert split.peak_activation_bytes == whole.peak_activation_bytes


# ---- errors -------------------------------------------------------------------------


def test_cost_model_must_match_the_stage_count() -> None:
    with pytest.raises(ValueError, match="cost model describes 3 stages.*has 4"):
        simulate(sw.schedules.generate("gpipe", 4, 2), CostModel.uniform(3))


def test_a_schedule_that_cannot_finish_is_reported() -> None:
    stuck = Schedule.from_csv("0B0,0F0\n1F0,1B0\n")
    with pytest.raises(ValueError, match="cannot finish: rank"):
        simulate(stuck)


# ---- cost model ---------------------------------------------------------------------


def test_cost_model_round_trips_through_json() -> None:
    costs = CostModel(
        num_stages=2,
        forward=(1.0, 1.5),
        backward_input=(2.0, 2.5),
        backward_weight=(1.0, 0.5),
        activation_bytes=(100.0, 80.0),
        weight_activation_bytes=(40.0, 30.0),
        parameter_bytes=(1e6, 2e6),
        output_bytes=(64.0, 64.0),
        latency=1e-5,
        sync_time=(0.1, 0.2),
    )
    text = json.dumps(costs.to_dict())
    assert "Infinity" not in text  # strict JSON: infinite bandwidth is written as null
    again = CostModel.from_dict(json.loads(text))
    assert again == costs and math.isinf(again.bandwidth)
    finite = CostModel.from_dict({**costs.to_dict(), "bandwidth": 1e9})
    assert finite.bandwidth == 1e9


def test_cost_model_from_dict_accepts_scalars_and_rejects_nonsense() -> None:
    costs = CostModel.from_dict({"num_stages": 3, "forward": 1, "backward_input": [1, 2, 3], "backward_weight": 0})
    assert costs.forward == (1.0, 1.0, 1.0) and costs.backward_input == (1.0, 2.0, 3.0)
    assert costs.bandwidth == math.inf and costs.step_time == (0.0, 0.0, 0.0)
    good = {"num_stages": 2, "forward": 1, "backward_input": 1, "backward_weight": 1}
    for bad, message in [
        ({**good, "fwd": 1}, "unknown fields"),
        ({k: v for k, v in good.items() if k != "forward"}, "'forward' is missing"),
        ({**good, "forward": [1, 2, 3]}, "3 entries, expected one per stage"),
        ({**good, "forward": -1}, "finite and >= 0"),
        ({**good, "forward": "fast"}, "a number or a list"),
        ({**good, "latency": -1.0}, "latency >= 0"),
        ({**good, "num_stages": 0}, "at least 1 stage"),
    ]:
        with pytest.raises(ValueError, match=message):
            CostModel.from_dict(bad)


def test_uniform_costs() -> None:
    costs = CostModel.uniform(2, forward=2, backward_input=3, backward_weight=4, comm_time=0.5, sync_time=1)
    assert costs.backward(1) == 7.0 and costs.transfer_time(0) == 0.5 and costs.sync_time == (1.0, 1.0)
    assert costs.weight_activation_bytes == (0.5, 0.5)
    with pytest.raises(ValueError, match="finite and >= 0"):
        CostModel.uniform(2, forward=math.inf)


# ---- the simulator's own rule, on random costs --------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    p=st.integers(1, 5),
    m=st.integers(1, 7),
    latency=st.sampled_from([0.0, 0.5, 1.25]),
    split=st.booleans(),
)
def test_every_action_starts_as_soon_as_its_rank_and_input_allow(
    data: st.DataObject, p: int, m: int, latency: float, split: bool
) -> None:
    name = data.draw(st.sampled_from(sw.schedule_names()))
    try:
        schedule = sw.schedules.generate(name, p, m)
    except ValueError:
        return
    if split:
        schedule = sw.passes.split_backward(schedule)
    n = schedule.num_stages
    times = st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), min_size=n, max_size=n)
    costs = CostModel(
        num_stages=n,
        forward=tuple(data.draw(times)),
        backward_input=tuple(data.draw(times)),
        backward_weight=tuple(data.draw(times)),
        activation_bytes=(1.0,) * n,
        weight_activation_bytes=(0.5,) * n,
        parameter_bytes=(0.0,) * n,
        output_bytes=tuple(data.draw(times)),
        latency=latency,
        bandwidth=2.0,
    )
    result = simulate(schedule, costs)
    # each message arrives its transfer time after it leaves; a rank's messages to another rank (every rank a
    # machine of its own here) leave one after another, each holding the link for its bytes' time
    arrives = {}
    for row in result.timeline.by_rank():
        lane = 0.0
        for e in row:
            out = produces(e.action, n)
            if out is None:
                continue
            size_stage = out.stage if out.direction == "F" else out.stage - 1
            if schedule.placement[out.stage + (1 if out.direction == "F" else -1)] == e.rank:
                arrives[out] = e.end
                continue
            leaves = max(e.end, lane)
            lane = leaves + costs.output_bytes[size_stage] / costs.bandwidth
            arrives[out] = leaves + costs.transfer_time(size_stage)
    for row in result.timeline.by_rank():
        free = 0.0
        for e in row:
            ready = free
            need = consumes(e.action, n)
            if need is not None:
                ready = max(ready, arrives[need])
            assert e.start == pytest.approx(ready), e
            free = e.end
    busy = max(result.timeline.busy(r) for r in range(p))
    assert result.makespan >= busy - 1e-9


def test_actions_outside_the_schedule_are_reported() -> None:
    schedule = Schedule("bad", 2, (0,), ((Action(0, Kind.F, 0), Action(0, Kind.F, 2)),))
    with pytest.raises(ValueError, match="rank 0 runs 0F2, outside stages 0..0 and micro-batches 0..1"):
        simulate(schedule)
