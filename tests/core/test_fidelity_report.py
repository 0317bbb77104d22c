"""The fidelity benchmark's pure parts (benchmarks/fidelity): its ranking check, errors, a measured step taken
apart, the runtime's costs added to a cost model and issue 39's "it pays" checks, on made-up figures (no run,
no timing)."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.fidelity.breakdown import stage_means, step_record, step_times
from benchmarks.fidelity.predicted import bounds_of, compute_scale, full_backward, with_measured, with_overheads
from benchmarks.fidelity.report import error, pays_checks, ranking_violations, stage_rows, summarize
from benchmarks.fidelity.tables import job_section

from stagewise import CostModel


def test_the_ranking_holds_only_where_the_simulation_is_5_percent_apart() -> None:
    sim = {"a": 100.0, "b": 104.0, "c": 120.0, "d": 200.0}
    assert ranking_violations(sim, {"a": 10, "b": 9, "c": 11, "d": 30}) == []  # a, b within 5 %: either order
    assert ranking_violations(sim, {"a": 10, "b": 12, "c": 9, "d": 30}) == [("a", "c"), ("b", "c")]
    assert ranking_violations(sim, {"a": 31, "b": 9, "c": 11, "d": 30}) == [("a", "c"), ("a", "d")]
    assert ranking_violations(sim, {"a": 10, "b": 10, "c": 10, "d": 10}) != []  # a tie is not "faster"


def test_error_is_the_prediction_over_the_measurement() -> None:
    assert error(110.0, 100.0) == pytest.approx(0.10)
    assert error(90.0, 100.0) == pytest.approx(-0.10)
    assert error(None, 1.0) is None and error(1.0, 0.0) is None


def test_a_step_is_taken_apart_into_compute_messages_gaps_head_and_tail() -> None:
    events = [("0F0", 0.001, 0.003), ("0SEND_F0", 0.003, 0.0032), ("0F1", 0.004, 0.006), ("0B0", 0.007, 0.011),
              ("0RECV_B0", 0.0065, 0.007)]  # fmt: skip
    r = step_record(events, wall=0.012, cpu=0.010)
    assert r["compute"] == pytest.approx({"F": 0.004, "I": 0.0, "W": 0.0, "B": 0.004})
    assert r["per_stage"] == {"F0": [pytest.approx(0.004), 2], "B0": [pytest.approx(0.004), 1]}
    assert r["messages"] == 2 and r["comm"] == pytest.approx(0.0007)
    assert r["head"] == pytest.approx(0.001) and r["tail"] == pytest.approx(0.001)
    assert r["gaps"] == pytest.approx(0.010 - 0.0087)  # the span less every action's time
    other = step_record([("1F0", 0.0, 0.002)], wall=0.004, cpu=0.0)
    assert stage_means([[r], [other]]) == pytest.approx({"F0": 0.002, "B0": 0.004, "F1": 0.002})
    assert step_times([[r, other], [other, r]]) == [0.012, 0.012]


def test_the_runtime_costs_go_where_the_planner_puts_them() -> None:
    costs = CostModel.uniform(3, forward=1.0, backward_input=2.0, backward_weight=1.0, backward_full=2.5)
    out = with_overheads(costs, action=0.5, message=0.25)
    fixed = [0.75, 1.0, 0.75]  # one message on an end stage, two in the middle
    assert out.forward == pytest.approx([1 + c for c in fixed])
    assert out.backward_input == pytest.approx([2 + c / 2 for c in fixed])
    assert out.backward_weight == pytest.approx([1 + c / 2 for c in fixed])
    assert full_backward(out) == pytest.approx([2.5 + c for c in fixed])
    bare = CostModel.uniform(2, backward_input=2.0, backward_weight=1.0)  # no B measured: B is I + W
    assert full_backward(with_overheads(bare, 1.0, 0.0)) == pytest.approx([4.0, 4.0])
    measured = with_measured(costs, {"F0": 7.0, "I2": 9.0, "B1": 8.0})
    assert measured.forward == (7.0, 1.0, 1.0) and measured.backward_input == (2.0, 2.0, 9.0)
    assert full_backward(measured) == (2.5, 8.0, 2.5)
    assert bounds_of([range(0, 3), range(3, 5)]) == [0, 3, 5]


def test_the_group_s_compute_scale_multiplies_each_kind_with_its_overhead() -> None:
    costs = CostModel.uniform(3, forward=1.0, backward_input=2.0, backward_weight=1.0, backward_full=2.5)
    out = with_overheads(costs, 0.5, 0.25, scale=(1.1, 1.2, 1.3))
    fixed = [0.75, 1.0, 0.75]
    assert out.forward == pytest.approx([1.1 * (1 + c) for c in fixed])
    assert full_backward(out) == pytest.approx([1.2 * (2.5 + c) for c in fixed])
    assert out.backward_input == pytest.approx([1.3 * (2 + c / 2) for c in fixed])
    assert out.backward_weight == pytest.approx([1.3 * (1 + c / 2) for c in fixed])
    assert compute_scale({}) == (1.0, 1.0, 1.0)
    assert compute_scale({"compute_scale": [1.1, 1.2]}) == (1.1, 1.2, 1.2)  # older code: I + W at B's
    assert compute_scale({"compute_scale": [1.1, 1.2, 1.3]}) == (1.1, 1.2, 1.3)


def _schedule(steps: list[float], sim: float, peak: float, *, split: bool, bounds: list[int]) -> dict[str, Any]:
    """One schedule of a made-up 2-rank job: each step's wall time on both ranks, its prediction and peaks."""
    kinds = ("I", "W") if split else ("B",)
    per_stage = {f"{k}{s}": [0.01, 2] for s in (0, 1) for k in ("F", *kinds)}
    record = lambda wall: {"wall": wall, "cpu": wall, "compute": {"F": 0.02, "I": 0.02 * split,  # noqa: E731
                           "W": 0.02 * split, "B": 0.02 * (not split)}, "per_stage": per_stage, "comm": 0.001,
                           "messages": 4, "other": 0.0, "gaps": 0.001, "head": 0.0, "tail": 0.001}  # fmt: skip
    costs = {k: [0.004, 0.004] for k in "FIW"} | {"B": [0.008, 0.008], "saved": [110, 100], "held": [99, 90]}
    memory = {"peak_bytes": peak, "forward_bytes": {"0,0": 100, "1,0": 100},
              "weight_bytes": {"0,0": 50, "1,0": 80} if split else {}}  # fmt: skip
    predicted = {"makespan": sim, "peak_bytes": [peak, peak], "with_runtime": sim, "costs": costs}
    return {"schedule": "x", "stages": 2, "bounds": bounds, "records": [[record(t) for t in steps]] * 2,
            "memory": [memory, memory], "predicted": predicted}  # fmt: skip


def _job() -> dict[str, Any]:
    cut = [0, 2, 4]
    return {
        "workload": "w", "title": "W", "d_model": 256, "ranks": 2, "microbatch": 2, "microbatches": 8,
        "seconds": 1.0, "profile": "{}",
        "calibration": {"latency": 1e-4, "bandwidth": None, "action": 0.0, "message": 0.0, "step": 0.0, "cores": 2},
        "schedules": {
            "1f1b": _schedule([1.0, 1.1, 0.9], 1.0, 1000, split=False, bounds=cut),
            "zb-h1": _schedule([0.9, 0.95, 0.85], 0.9, 1040, split=True, bounds=cut),
            "zb-v": _schedule([1.05], 0.8, 1500, split=True, bounds=[0, 1, 2, 3, 4]),
            "auto": _schedule([0.86], 0.9, 1040, split=True, bounds=cut),
        },
    }  # fmt: skip


def test_a_job_becomes_rows_with_errors_and_the_pays_checks() -> None:
    job = _job()
    rows = {r["label"]: r for r in summarize(job)}
    assert rows["1f1b"]["measured"] == 1.0 and rows["zb-h1"]["measured"] == 0.9  # medians of the slowest rank
    assert rows["zb-v"]["time_error"] == pytest.approx(0.8 / 1.05 - 1) and not rows["zb-v"]["goal"]
    assert rows["1f1b"]["goal"] and rows["1f1b"]["memory_error"] == 0.0
    assert rows["1f1b"]["causes"]["compute_ratio"] == pytest.approx(0.04 / (2 * 2 * 0.004 + 2 * 2 * 0.008))
    checks = {what: (ok, figures) for what, ok, figures in pays_checks(job, list(rows.values()))}
    assert checks["zb-h1 faster than 1f1b by at least half the simulated gain"][0] is True
    assert checks["zb-v faster than 1f1b by at least half the simulated gain"][0] is False  # slower when measured
    assert checks["zb-h1's activation peak <= 1.05x 1f1b's"][0] is True
    assert checks["auto within 2 % of the fastest hand-written schedule"][0] is True  # 0.86 / 0.9
    job["schedules"]["zb-h1"] = _schedule([0.97], 0.9, 1040, split=True, bounds=[0, 2, 4])  # gains 3 % of 10 %
    rows = {r["label"]: r for r in summarize(job)}
    checks = {what: (ok, figures) for what, ok, figures in pays_checks(job, list(rows.values()))}
    assert checks["zb-h1 faster than 1f1b by at least half the simulated gain"] == (
        False,
        "measured 0.970x, simulated 0.900x",
    )
    job = _job()
    split = stage_rows(job)
    assert [r["profile_share"] for r in split] == [0.9, 0.9] and [r["metered_share"] for r in split] == [0.5, 0.8]
    assert [r["metered_saved"] for r in split] == [100, 100] and [r["metered_held"] for r in split] == [50, 80]
    assert split[0]["measured_ratio"] == pytest.approx(2.0) and split[0]["profile_ratio"] == pytest.approx(1.0)
    text = job_section(job, list(rows.values()), oversubscribed=False)
    assert "zb-v simulated 800.0 < 1f1b 1000.0 but measured 1050.0 vs 1000.0" in text and "**no**" in text


def test_the_planner_s_prediction_waits_for_the_tied_layers_sum() -> None:
    """The GPT ties its head to its embedding (layers 0 and 3, on ranks 0 and 1): on a link of 1 s latency the sum
    is a ring of 2 ranks, 2 steps of a notice and a message, 4 s after stage 0's last backward, which ends the
    step. "+ runtime" waits for it; the plain simulation does not (the simulator alone)."""
    from benchmarks.fidelity.predicted import predict, tied_of

    from helpers.profiles import fake_profile
    from stagewise import build_schedule
    from stagewise.planning import Link

    profile = fake_profile([3.0] * 4, params=[8.0, 0.0, 0.0, 0.0])
    schedule = build_schedule("1f1b", 2, 4)
    costs = profile.cost_model([0, 2, 4], latency=1.0)
    tied = tied_of(profile, [[0, 3]], [2, 2], schedule, Link(1.0, float("inf")))
    assert [(t.stages, t.seconds) for t in tied] == [((0, 1), 4.0)]
    got = predict(schedule, costs, {"step": 0.5}, None, tied=tied)
    assert got["with_runtime"] == pytest.approx(got["makespan"] + 4.0 + 0.5)
    assert predict(schedule, costs, {"step": 0.5}, None)["with_runtime"] == pytest.approx(got["makespan"] + 0.5)
