"""The synthesizer: a validated schedule, never slower than a registered one that fits, within its caps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from helpers.examples import DEEP
from stagewise.ir import Kind, Schedule
from stagewise.partition import LayerCost, LayerProfile
from stagewise.passes import split_backward
from stagewise.planning import Link, plan, transformer_profile
from stagewise.schedules import generate, schedule_info, schedule_names
from stagewise.simulation import CostModel, simulate
from stagewise.synthesis import lower_bound, report_of, synthesize, synthesize_for
from stagewise.validate import validate_schedule


def costs_of(kind: str, n: int) -> CostModel:
    """A few shapes of cost: uniform, latency, I : W = 3 : 1, uneven stages with uneven I / W, W keeping nothing, and
    a measured B below I + W on some stages (and above it on one)."""
    base = CostModel.uniform(n, weight_activation_bytes=1 / 3)
    if kind == "latency":
        return replace(base, latency=0.3)
    if kind == "iw":
        return replace(base, backward_input=(1.5,) * n, backward_weight=(0.5,) * n, latency=0.2)
    if kind == "uneven":
        f = tuple(1.0 + (s % 3) * 0.5 for s in range(n))
        return replace(base, forward=f, backward_input=tuple(x * 0.8 for x in f), backward_weight=(1.2,) * n)
    if kind == "no-w-memory":
        return replace(base, weight_activation_bytes=(0.0,) * n, latency=0.3)
    if kind == "measured-b":
        return replace(base, latency=0.2, backward_full=tuple((1.4, 2.0, 1.8, 2.1)[s % 4] for s in range(n)))
    return base


def peaks(schedule: Schedule, costs: CostModel) -> list[float]:
    """Per rank, activations held at once in micro-batches, read off the simulator (independent of the search)."""
    units = replace(
        costs,
        activation_bytes=(1.0,) * costs.num_stages,
        weight_activation_bytes=tuple(
            min(k, a) / a if a > 0 else 0.0 for k, a in zip(costs.weight_activation_bytes, costs.activation_bytes)
        ),
    )
    return [x / schedule.virtual_stages for x in simulate(schedule, units).peak_activation_bytes]


def registered(p: int, m: int, v: int, placement: str) -> list[Schedule]:
    out = []
    for name in schedule_names(synchronous=True):
        info = schedule_info(name)
        if (info.virtual_stages is None or v in info.virtual_stages) and (v == 1 or info.placement == placement):
            out.append(generate(name, p, m, v))
    return out


GRID = [(p, m, 1, "loop") for p in (1, 2, 3, 4) for m in (1, 2, 5, 8) if (p, m) != (3, 8)]
GRID += [(p, m, 2, pl) for p in (2, 3) for m in (1, 4) for pl in ("v", "loop")]


KINDS = ["uniform", "latency", "iw", "uneven", "no-w-memory", "measured-b"]
# `make test`: each shape under two of the kinds, in turn (every shape and every kind still met); `make test-deep`: all
CASES = [(*shape, k) for i, shape in enumerate(GRID) for j, k in enumerate(KINDS) if DEEP or j in (i % 6, (i + 3) % 6)]


@pytest.mark.parametrize(("p", "m", "v", "placement", "kind"), CASES)
def test_never_slower_than_a_registered_schedule_that_fits(kind: str, p: int, m: int, v: int, placement: str) -> None:
    """Under 1F1B's memory and twice it: validated, within its caps, and no registered schedule that fits the
    same caps is faster; the reported makespan is the simulator's, and the bound is below it."""
    costs = costs_of(kind, p * v)
    for factor in (1, 2):
        cap = factor * min(p, m)
        got = synthesize(costs, p, m, memory=cap, virtual_stages=v, placement=placement)
        validate_schedule(got)
        assert got.is_complete and got.num_ranks == p and got.num_microbatches == m
        report = report_of(got)
        ms = simulate(got, costs).makespan
        assert report.makespan == pytest.approx(ms, rel=1e-12)
        assert report.lower_bound <= ms * (1 + 1e-12)
        assert max(peaks(got, costs)) <= cap + 1e-9
        for hand in registered(p, m, v, placement):
            if max(peaks(hand, costs)) <= cap + 1e-9:
                assert ms <= simulate(hand, costs).makespan * (1 + 1e-12), (hand.name, cap)


def test_more_memory_buys_time() -> None:
    """Latency 0.3 at p = 4, m = 8: at 1F1B's memory zb-h1 (30.6) is what fits; at twice it the bound (27.9)
    is reached, with more than 1F1B's activations held."""
    costs = costs_of("latency", 4)
    tight, loose = synthesize(costs, 4, 8, memory=4), synthesize(costs, 4, 8, memory=8)
    assert report_of(tight).makespan == pytest.approx(30.6)
    assert report_of(tight).baseline == "zb-h1"
    assert report_of(loose).makespan == pytest.approx(27.9)
    assert report_of(loose).makespan == pytest.approx(report_of(loose).lower_bound)
    assert max(peaks(loose, costs)) > 4


def test_beats_zb_h1_when_w_keeps_no_memory() -> None:
    """When W holds no activations (the simulator's count of micro-batches), 1F1B's memory is enough to beat
    zb-h1 with latency: 28.8 against 30.6 at p = 4, m = 8."""
    costs = costs_of("no-w-memory", 4)
    got = report_of(synthesize(costs, 4, 8, memory=4))
    assert got.makespan == pytest.approx(28.8)
    assert got.baseline_makespan == pytest.approx(30.6)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_uniform_costs_reach_the_bound(p: int, m: int) -> None:
    got = report_of(synthesize(CostModel.uniform(p), p, m, memory=2 * min(p, m)))
    assert got.makespan == max(3 * m + p - 1, 2 * m + 2 * p - 1) == got.lower_bound


def test_byte_caps_per_rank_hold() -> None:
    """``memory_bytes`` caps each rank's simulated ``peak_activation_bytes``."""
    costs = replace(costs_of("latency", 4), activation_bytes=(4.0, 2.0, 2.0, 8.0), weight_activation_bytes=(1.0,) * 4)
    caps = [16.0, 8.0, 12.0, 8.0]
    got = synthesize(costs, 4, 8, memory=math.inf, memory_bytes=caps)
    held = simulate(got, costs).peak_activation_bytes
    assert all(h <= c + 1e-9 for h, c in zip(held, caps)), held
    assert report_of(got).peaks["bytes"] == pytest.approx(tuple(held))


def test_fuses_i_and_w_into_b_only_where_it_costs_nothing() -> None:
    got = synthesize(CostModel.uniform(3), 3, 6, memory=3)
    kinds = {a.kind for acts in got.ranks for a in acts}
    assert Kind.B in kinds
    split = split_backward(got.compute_only())
    assert simulate(split, CostModel.uniform(3)).makespan == simulate(got, CostModel.uniform(3)).makespan


def test_deterministic() -> None:
    costs = costs_of("iw", 4)
    assert synthesize(costs, 4, 8).to_text() == synthesize(costs, 4, 8).to_text()


def test_one_rank_one_microbatch() -> None:
    got = synthesize([(1.0, 2.0, 0.5)], 1, 1)
    validate_schedule(got)
    assert report_of(got).makespan == 3.5 == lower_bound([(1.0, 2.0, 0.5)], 1, 1)


def test_cost_rows_are_a_short_form() -> None:
    rows = [(1.0, 1.0, 1.0), (2.0, 1.5, 0.5)]
    got = synthesize(rows, 2, 4)
    assert report_of(got).lower_bound == lower_bound(rows, 2, 4)


# ---- bad input ----------------------------------------------------------------------------------------


def test_costs_of_the_wrong_shape_name_the_stage() -> None:
    with pytest.raises(ValueError, match=r"describes 6 stages, 8 are needed: stage\(s\) 6, 7 have no costs"):
        synthesize(CostModel.uniform(6), 4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="describes 5 stages, but only 4 are placed.*stage 4 has no rank"):
        synthesize(CostModel.uniform(5), 4, 8)
    with pytest.raises(ValueError, match=r"stage 1 costs \(1.0, 2.0\); expected \(forward, backward_input"):
        synthesize([(1.0, 1.0, 1.0), (1.0, 2.0)], 2, 4)
    with pytest.raises(ValueError, match="stage 0 costs .*three finite times >= 0"):
        synthesize([(-1.0, 1.0, 1.0), (1.0, 1.0, 1.0)], 2, 4)
    with pytest.raises(ValueError, match="3 stage cost rows for 2 stages.*stage 2 has no rank"):
        synthesize([(1.0, 1.0, 1.0)] * 3, 2, 4)


def test_a_cap_nothing_fits_names_the_smallest_that_works() -> None:
    with pytest.raises(ValueError, match="cap of 0.5 micro-batches on rank 0 fits no schedule.*smallest cap that "
                       "works is 1 micro-batches"):  # fmt: skip
        synthesize(CostModel.uniform(4), 4, 8, memory=0.5)
    costs = replace(CostModel.uniform(4), activation_bytes=(4.0, 2.0, 2.0, 8.0))
    with pytest.raises(ValueError, match="cap of 7 bytes on rank 3 .*holds 8 bytes there.*smallest cap that works is "
                       r"8 bytes \(per rank: 4, 2, 2, 8\)"):  # fmt: skip
        synthesize(costs, 4, 8, memory_bytes=[8.0, 8.0, 8.0, 7.0])
    # the smallest cap that works does work
    validate_schedule(synthesize(CostModel.uniform(4), 4, 8, memory=1))


def test_other_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_ranks must be an int >= 1"):
        synthesize(CostModel.uniform(1), 0, 4)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        synthesize(CostModel.uniform(2), 2, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement must be 'loop' or 'v'"):
        synthesize(CostModel.uniform(4), 2, 4, virtual_stages=2, placement="zigzag")
    with pytest.raises(ValueError, match="memory has 3 caps, expected one per rank"):
        synthesize(CostModel.uniform(4), 4, 4, memory=[4, 4, 4])
    for effort in (-3, 2.5):  # (a negative effort ran one evaluation per start, silently)
        with pytest.raises(ValueError, match=f"effort .* must be an int >= 0, got {effort}"):
            synthesize(CostModel.uniform(2), 2, 4, effort=effort)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement 'v' zig-zags two or more stages per rank"):
        synthesize(CostModel.uniform(2), 2, 4, placement="v")  # (it ran the loop, silently)


# ---- what the runtime and the planner call --------------------------------------------------------------


def _profile() -> LayerProfile:
    layers = [LayerCost(f"l{k}", 1.0 + k % 2, 1.0, 0.5 + k % 3, 0.0, 2.0, 0.5, 1.0, 1.0) for k in range(6)]
    return LayerProfile(tuple(replace(x, backward=x.backward_input + x.backward_weight) for x in layers), "cpu", 1, 0)


def test_synthesize_for_a_profile_is_synthesize_of_its_cost_model() -> None:
    prof = _profile()
    got = synthesize_for(prof, 3, 6, partition=[2, 3, 1], latency=0.1)
    want = synthesize(prof.cost_model([0, 2, 5, 6], latency=0.1), 3, 6)
    assert got.to_text() == want.to_text()
    assert synthesize_for(want.meta and prof.cost_model([0, 2, 5, 6], latency=0.1), 3, 6).to_text() == got.to_text()
    with pytest.raises(ValueError, match="needs partition="):
        synthesize_for(prof, 3, 6)
    with pytest.raises(ValueError, match=r"partition \[2, 2, 1\] must be layer counts"):
        synthesize_for(prof, 3, 6, partition=[2, 2, 1])
    with pytest.raises(ValueError, match="already holds its stages"):
        synthesize_for(CostModel.uniform(3), 3, 6, partition=[2, 2, 2])


def test_the_planner_offers_auto_where_it_is_faster() -> None:
    """pp = 4 is the only layout that fits; the synthesized schedule beats every registered one there."""
    options = dict(global_batch=16, top=3, memory=140e9, recompute=(None,), intra=Link(latency=2e-3, bandwidth=1e12))
    prof = transformer_profile(blocks=16)
    without = plan(prof, 4, schedules=["1f1b", "zb-h1"], **options)  # type: ignore[arg-type]
    with_auto = plan(prof, 4, schedules=["1f1b", "zb-h1", "auto"], **options)  # type: ignore[arg-type]
    assert all(p.schedule != "auto" and p.synthesized is None for p in without)
    best = with_auto[0]
    assert best.schedule == "auto" and best.step_time < without[0].step_time
    schedule = best.pipeline_options()["schedule"]
    assert isinstance(schedule, Schedule) and schedule is best.synthesized
    validate_schedule(schedule)
    assert [p.schedule for p in with_auto].count("auto") == 1  # zb-h1's and 1f1b's plans lead to one schedule
    assert best.memory[0].activations <= best.memory[0].cap


def test_the_exact_model_proves_zb_h1_optimal_under_1f1bs_memory() -> None:
    """CP-SAT (the ``exact`` extra) on latency 0.3, p = 3, m = 4 under 1F1B's memory, W's third counted: nothing
    beats zb-h1; its orders come back valid and within the cap."""
    pytest.importorskip("ortools")
    costs = costs_of("latency", 3)
    got = synthesize(costs, 3, 4, memory=3, exact=20.0)
    validate_schedule(got)
    assert report_of(got).makespan == pytest.approx(simulate(generate("zb-h1", 3, 4), costs).makespan)
    assert max(peaks(got, costs)) <= 3 + 1e-9


def test_effort_zero_runs_no_local_search() -> None:
    """``effort=0``: the play-outs' best as it stands (it ran one evaluation per start); any effort searches on."""
    costs = costs_of("no-w-memory", 3)
    none, some = (report_of(synthesize(costs, 3, 4, memory=3, effort=e)) for e in (0, 200))
    assert some.evaluations > none.evaluations + 2 and some.makespan <= none.makespan


def test_the_exact_model_finds_what_the_heuristics_miss() -> None:
    """Latency 0.3, W keeping nothing, p = 3, m = 4, cap 3, no local search: the play-outs reach 16.2, the exact
    model 15.4 (bound 14.6), and its schedule validates within the cap."""
    pytest.importorskip("ortools")
    costs = costs_of("no-w-memory", 3)
    assert report_of(synthesize(costs, 3, 4, memory=3, effort=0)).makespan == pytest.approx(16.2)
    got = synthesize(costs, 3, 4, memory=3, effort=0, exact=10.0)
    validate_schedule(got)
    assert report_of(got).makespan == pytest.approx(15.4) == simulate(got, costs).makespan
    assert max(peaks(got, costs)) <= 3 + 1e-9


def test_the_exact_model_without_or_tools_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagewise.synthesis import synthesis

    monkeypatch.setattr(synthesis, "exact_available", lambda: False)
    with pytest.raises(ImportError, match=r"needs OR-Tools: pip install 'stagewise\[exact\]'"):
        synthesize(costs_of("latency", 3), 3, 4, memory=3, exact=1.0)


def test_a_plan_written_as_json_reads_back_as_the_same_plan_synthesized_schedule_too() -> None:
    """``stagewise plan --json`` on one machine, ``Pipeline.from_plan`` on another: ``Plan.from_dict`` reads a plan
    back with its synthesized schedule's actions (the digest covers them); an edited plan is refused."""
    import json

    from stagewise.planning import Plan

    options = dict(global_batch=16, top=3, memory=140e9, recompute=(None,), intra=Link(latency=2e-3, bandwidth=1e12))
    plans = plan(transformer_profile(blocks=16), 4, schedules=["1f1b", "zb-h1", "auto"], **options)  # type: ignore[arg-type]
    assert any(p.schedule == "auto" for p in plans) and any(p.schedule != "auto" for p in plans)
    for p in plans:
        back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
        assert (
            back == p and back.digest() == p.digest() and back.pipeline_options().keys() == p.pipeline_options().keys()
        )
        if p.synthesized is not None:
            assert back.synthesized is not None and back.synthesized.ranks == p.synthesized.ranks
            assert back.synthesized.placement == p.synthesized.placement
    edited = plans[0].to_dict() | {"microbatches": plans[0].microbatches + 1}
    with pytest.raises(ValueError, match="edited since"):
        Plan.from_dict(edited)
    bare = {k: v for k, v in next(p for p in plans if p.schedule == "auto").to_dict().items() if k != "synthesized"}
    with pytest.raises(ValueError, match="carries its synthesized schedule"):
        Plan.from_dict(bare)
