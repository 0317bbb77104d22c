"""Asynchronous schedules (PipeDream, 2BW, XPipe): the order, the version table against closed forms, the version
validator against mutants, version-count bounds, and the simulator's steady state and weight memory."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise.asynchronous import Version, live_versions, version_bound, version_table
from stagewise.ir import Action, Kind
from stagewise.validate.versions import _bounds, _rules

VARIANTS = [
    ("pipedream", {}),
    ("pipedream", {"stashing": False}),
    ("pipedream", {"vertical_sync": True}),
    ("pipedream-2bw", {}),
    ("xpipe", {}),
]
SIZES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4)]


def build(name: str, p: int, n: int, m: int, **opts: bool) -> sw.Schedule:
    return sw.schedules.async_schedule(name, p, n, m, **opts)


def supported(name: str, p: int, m: int) -> bool:
    return not (name == "pipedream-2bw" and m < p - 1)


# ---- the order and the table against closed forms ------------------------------------


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_every_variant_validates_and_lowers_over_the_grid(name: str, opts: dict[str, bool]) -> None:
    for p, m in SIZES:
        if not supported(name, p, m):
            with pytest.raises(ValueError, match="p - 1"):
                build(name, p, 3, m, **opts)
            continue
        for n in (1, 2, 5):
            schedule = build(name, p, n, m, **opts)
            complete = sw.passes.lower(schedule)
            sw.validate.validate_versions(complete)  # lowering adds communication, keeps the order and the table
            assert complete.meta["versions"] is schedule.meta["versions"]
            steps = [sum(a.kind is Kind.STEP for a in acts) for acts in complete.ranks]
            assert steps == [n] * p


def test_pipedream_versions_are_the_closed_forms() -> None:
    """m = 1, warm-up w = p - s - 1: c_F(s, i) = max(0, i - w), c_B(s, i) = i (one update per earlier backward)."""
    p, n = 4, 9
    tables = {
        pol: build("pipedream", p, n, 1, **opts).meta["versions"]
        for pol, opts in (("stash", {}), ("none", {"stashing": False}), ("vertical", {"vertical_sync": True}))
    }
    for s in range(p):
        w = p - s - 1
        for i in range(n):
            c_f = max(0, i - w)
            assert tables["stash"].forward[s][i] == tables["stash"].backward[s][i] == Version(c_f)
            assert tables["none"].forward[s][i] == Version(c_f)
            assert tables["none"].backward[s][i] == Version(i)
            assert tables["vertical"].forward[s][i] == tables["vertical"].backward[s][i] == Version(max(0, i - p + 1))


def test_2bw_uses_the_version_before_the_last() -> None:
    for p, m in [(2, 1), (3, 2), (4, 3), (4, 4), (3, 5)]:
        table = build("pipedream-2bw", p, 6, m).meta["versions"]
        for s in range(p):
            for i in range(6 * m):
                assert table.forward[s][i] == table.backward[s][i] == Version(max(0, i // m - 1))


def test_xpipe_predicts_each_minibatch_up_to_its_own_update() -> None:
    """Bellwether F of mini-batch t at stage s sees W^(c), c = c_F; it predicts d = t - c updates ahead."""
    p, n = 4, 7
    for m in (1, 2, 3):
        schedule = build("xpipe", p, n, m)
        table = schedule.meta["versions"]
        for s in range(p):
            w = p - s - 1
            for t in range(n):
                c = max(0, t * m - w) // m  # mini-batches whose backwards all precede F(t*m): B(0..tm-w-1)
                for k in range(m):
                    assert table.forward[s][t * m + k] == table.backward[s][t * m + k] == Version(c, t - c)
        assert all(v == Version(t // m) for t, v in enumerate(table.forward[p - 1]))  # no staleness at the end


def test_str_and_labels() -> None:
    assert (str(Version(3)), str(Version(1, 2))) == ("v3", "v1+2")
    labels = build("pipedream", 3, 4, 1).meta["versions"].labels()
    assert labels["0F3"] == "3v1" and labels["2B3"] == "3v3" and labels["1F2"] == "2v1"


# ---- version-count bounds -----------------------------------------------------------


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_live_versions_reach_the_closed_form_bounds(name: str, opts: dict[str, bool]) -> None:
    for p, m in SIZES:
        if not supported(name, p, m):
            continue
        schedule = build(name, p, 2 * p + 2, m, **opts)  # long enough for the steady state
        table = schedule.meta["versions"]
        peaks = [max(row) for row in live_versions(schedule.ranks, table)]
        assert peaks == [version_bound(table.policy, p, m, s) for s in range(p)], (name, opts, p, m)


def test_pipedream_stage_s_keeps_p_minus_s_versions() -> None:
    p = 5
    schedule = build("pipedream", p, 12, 1)
    peaks = [max(row) for row in live_versions(schedule.ranks, schedule.meta["versions"])]
    assert peaks == [p - s for s in range(p)]
    assert [version_bound("2bw", 4, 4, s) for s in range(4)] == [2] * 4


# ---- the validator against mutants ----------------------------------------------------


def _with_table(schedule: sw.Schedule, **changes: object) -> sw.Schedule:
    table = dataclasses.replace(schedule.meta["versions"], **changes)
    return sw.Schedule(
        schedule.name, schedule.num_microbatches, schedule.placement, schedule.ranks, {"versions": table}
    )


def test_a_table_claiming_stashing_with_unstashed_backwards_is_refused() -> None:
    good = build("pipedream", 3, 5, 1)
    unstashed = build("pipedream", 3, 5, 1, stashing=False).meta["versions"]
    mutant = _with_table(good, backward=unstashed.backward)  # policy still "stash"
    with pytest.raises(sw.ScheduleError, match=r"1B2 is tabled to use v2, but policy 'stash'.*gives v1"):
        sw.validate.validate_versions(mutant)


def test_the_stash_rule_itself_is_checked() -> None:
    """Even a table that matches its policy's computation is refused when that policy breaks its own rule."""
    schedule = build("pipedream", 3, 5, 1, stashing=False)
    table = schedule.meta["versions"]
    relabelled = dataclasses.replace(table, policy="stash")
    problems = _rules(_with_table(schedule, policy="stash"), relabelled)
    assert any("differentiates v2 but 1F2 ran on v1" in p for p in problems)


def test_vertical_sync_off_is_caught() -> None:
    good = build("pipedream", 3, 5, 1, vertical_sync=True)
    stash = build("pipedream", 3, 5, 1).meta["versions"]
    mutant = _with_table(good, forward=stash.forward, backward=stash.backward)
    with pytest.raises(sw.ScheduleError, match="policy 'vertical'"):
        sw.validate.validate_versions(mutant)
    problems = _rules(mutant, dataclasses.replace(stash, policy="vertical"))
    assert any("entered stage 0 at v0" in p for p in problems)


def test_a_version_that_does_not_exist_yet_is_refused() -> None:
    schedule = build("pipedream", 2, 3, 1)
    table = schedule.meta["versions"]
    fwd = [list(r) for r in table.forward]
    fwd[0][1] = Version(2)
    problems = _rules(schedule, dataclasses.replace(table, forward=tuple(map(tuple, fwd))))
    assert any("0F1 needs v2, but stage 0 has made only versions 0..0 there" in p for p in problems)


def test_a_step_before_its_minibatch_is_done_is_refused() -> None:
    schedule = build("pipedream-2bw", 2, 2, 2)
    acts = list(schedule.ranks[1])
    first_step = acts.index(Action(1, Kind.STEP))
    acts.insert(1, acts.pop(first_step))  # STEP right after 1F0
    mutant = sw.Schedule(schedule.name, 4, schedule.placement, (schedule.ranks[0], tuple(acts)), dict(schedule.meta))
    with pytest.raises(sw.ScheduleError, match="STEP 0 of stage 1 comes before the last backward of mini-batch 0"):
        sw.validate.validate_versions(mutant)


def test_split_backward_is_refused_for_async() -> None:
    schedule = sw.passes.split_backward(build("pipedream", 2, 2, 1))
    with pytest.raises(sw.ScheduleError, match="not I/W"):
        sw.validate.validate_versions(schedule)


def test_too_many_versions_is_refused() -> None:
    schedule = build("pipedream", 3, 8, 1)
    table = schedule.meta["versions"]
    assert _bounds(schedule, table) == []
    assert _bounds(schedule, dataclasses.replace(table, policy="2bw"))  # stage 0 keeps 3 > 2


# ---- bad input ----------------------------------------------------------------------


def test_bad_options_name_the_constraint() -> None:
    with pytest.raises(ValueError, match="vertical_sync=True needs stashing=True"):
        sw.schedules.async_schedule("pipedream", 2, 2, stashing=False, vertical_sync=True)
    with pytest.raises(ValueError, match="stashing / vertical_sync belong to 'pipedream'"):
        sw.schedules.async_schedule("xpipe", 2, 2, stashing=False)
    with pytest.raises(ValueError, match="at least p - 1 = 3 micro-batches per mini-batch, got 2"):
        sw.schedules.async_schedule("pipedream-2bw", 4, 3, 2)
    with pytest.raises(ValueError, match="minibatches=0"):
        sw.schedules.async_schedule("pipedream", 2, 0)
    with pytest.raises(ValueError, match="unknown asynchronous schedule 'gpipe'"):
        sw.schedules.async_schedule("gpipe", 2, 2)
    with pytest.raises(ValueError, match="m must be a multiple of 4"):
        sw.schedules.generate("xpipe", 4, 6)
    with pytest.raises(ValueError, match="unknown weight-version policy"):
        version_table([], 1, "magic", 1, 1)


def test_registry_builds_async_schedules_by_name() -> None:
    info = sw.schedule_info("pipedream")
    assert not info.synchronous and sw.schedule_info("1f1b").synchronous
    s = sw.build_schedule("pipedream", 3, 5)
    assert s.meta["versions"].minibatches == 5 and s.meta["versions"].microbatches == 1
    s = sw.build_schedule("pipedream-2bw", 3, 6)
    assert (s.meta["versions"].minibatches, s.meta["versions"].microbatches) == (2, 3)
    assert [s.meta["versions"].minibatch_of(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]


# ---- simulator --------------------------------------------------------------------


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_window_bubble_and_steady_state_period_are_closed_forms(name: str, opts: dict[str, bool]) -> None:
    """Uniform F = 1, B = 2, free transfers: the window takes (Nm + p - 1) * 3 and a mini-batch leaves every 3m."""
    for p, m in [(2, 1), (3, 2), (4, 3), (4, 4)]:
        if not supported(name, p, m):
            continue
        n = 6
        schedule = sw.passes.lower(build(name, p, n, m, **opts))
        costs = sw.CostModel.uniform(p, forward=1, backward_input=1, backward_weight=1, parameter_bytes=10)
        result = sw.simulate(schedule, costs)
        assert result.makespan == (n * m + p - 1) * 3.0
        assert result.bubble_ratio == pytest.approx((p - 1) / (n * m + p - 1), abs=1e-12)
        report = sw.simulation.async_report(schedule, result)
        assert report.period == 3.0 * m
        assert report.throughput == pytest.approx(n / ((n * m + p - 1) * 3.0))
        table = schedule.meta["versions"]
        bounds = [version_bound(table.policy, p, m, s) for s in range(p)]
        assert all(v <= b for v, b in zip(report.peak_versions, bounds))
        assert report.peak_weight_bytes == [10.0 * v for v in report.peak_versions]
        peak_act = result.peak_activation_bytes
        assert all(a <= t <= a + w for a, w, t in zip(peak_act, report.peak_weight_bytes, report.peak_total_bytes))


def test_weight_memory_counts_pipedream_stashes() -> None:
    p = 4
    schedule = sw.passes.lower(build("pipedream", p, 10, 1))
    costs = dataclasses.replace(sw.CostModel.uniform(p), parameter_bytes=(8.0, 4.0, 2.0, 1.0))
    report = sw.simulation.async_report(schedule, sw.simulate(schedule, costs))
    assert report.peak_versions == [4, 3, 2, 1]
    assert report.peak_weight_bytes == [32.0, 12.0, 4.0, 1.0]
    with pytest.raises(ValueError, match="not an asynchronous schedule"):
        sw.simulation.async_report(sw.build_schedule("1f1b", 2, 2), sw.simulate(sw.build_schedule("1f1b", 2, 2)))


def test_png_marks_versions(tmp_path: object) -> None:
    from stagewise.simulation import labelled_timeline

    schedule = sw.passes.lower(build("pipedream", 3, 4, 1))
    timeline = labelled_timeline(schedule, sw.simulate(schedule))
    assert timeline.meta["labels"]["0F3"] == "3v1"
    pytest.importorskip("matplotlib")
    import pathlib

    out = pathlib.Path(str(tmp_path)) / "pd.png"
    sw.render_png(timeline, out)
    assert out.stat().st_size > 1000


def test_cli_reports_weight_versions(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    import json

    from stagewise.cli.main import main

    assert main(["simulate", "-s", "pipedream", "-p", "4", "-m", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak_weight_versions"] == [4, 3, 2, 1]
    assert report["makespan"] == (10 + 4 - 1) * 3.0
    assert main(["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--json"]) == 0
    assert "peak_weight_versions" not in json.loads(capsys.readouterr().out)


@settings(max_examples=40, deadline=None)
@given(
    variant=st.sampled_from(VARIANTS),
    p=st.integers(1, 4),
    n=st.integers(1, 4),
    m=st.integers(1, 3),
    data=st.data(),
)
def test_any_changed_table_entry_is_refused(
    variant: tuple[str, dict[str, bool]], p: int, n: int, m: int, data: st.DataObject
) -> None:
    """The generated table passes; the same table with one F or B entry moved to another version does not."""
    name, opts = variant
    if not supported(name, p, m):
        return
    schedule = build(name, p, n, m, **opts)
    sw.validate.validate_versions(schedule)
    table = schedule.meta["versions"]
    s = data.draw(st.integers(0, p - 1))
    i = data.draw(st.integers(0, n * m - 1))
    which = data.draw(st.sampled_from(["forward", "backward"]))
    rows = [list(r) for r in getattr(table, which)]
    old = rows[s][i]
    rows[s][i] = data.draw(st.sampled_from([Version(old.base + 1, old.ahead), Version(old.base, old.ahead + 1)]))
    with pytest.raises(sw.ScheduleError, match=f"{s}{which[0].upper()}{i} is tabled to use"):
        sw.validate.validate_versions(_with_table(schedule, **{which: tuple(map(tuple, rows))}))


def _live_versions_brute_force(ranks: list[tuple[Action, ...]], table: object) -> list[list[int]]:
    """The definition, action by action: the current weights, older ones still to be used, predictions in use."""
    out = []
    for acts in ranks:
        uses = [(j, a.stage, (table.forward if a.kind is Kind.F else table.backward)[a.stage][a.microbatch])  # type: ignore[attr-defined]
                for j, a in enumerate(acts) if a.kind in (Kind.F, Kind.B)]  # fmt: skip
        current = 0
        counts = []
        for j, a in enumerate(acts):
            live = {Version(current)}
            for k, _, v in uses:
                if v.ahead == 0 and v.base <= current and k >= j:
                    live.add(v)
            for _, _, v in uses:
                if v.ahead:
                    span = [k for k, _, w in uses if w == v]
                    if min(span) <= j <= max(span):
                        live.add(v)
            counts.append(len(live))
            current += a.kind is Kind.STEP
        out.append(counts)
    return out


@pytest.mark.parametrize("name,opts", VARIANTS)
def test_live_version_sweep_equals_the_definition(name: str, opts: dict[str, bool]) -> None:
    for p, m in [(1, 1), (2, 1), (3, 2), (4, 1), (4, 3), (5, 2)]:
        if not supported(name, p, m):
            continue
        schedule = sw.passes.lower(build(name, p, 2 * p + 1, m, **opts))
        table = schedule.meta["versions"]
        assert live_versions(schedule.ranks, table) == _live_versions_brute_force(list(schedule.ranks), table)
