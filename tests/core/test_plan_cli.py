"""``stagewise plan``: a table of the top plans, JSON that matches sw.plan, a PNG, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Calibration, LayoutCost, Link
from stagewise.planning.ranking import NOISE
from stagewise.planning.units import in_unit, unit_for


def _profile(batch: int | None = 2) -> LayerProfile:
    times = [0.5, 1.0, 1.0, 1.0, 1.0, 2.0]
    layers = tuple(LayerCost(f"l{k}", t, t, t, 2 * t, 100.0, 50.0, 1000.0, 10.0) for k, t in enumerate(times))
    return LayerProfile(layers, "cpu", 3, 1, batch=batch)


def test_profile_json_round_trips() -> None:
    for p in (_profile(), _profile(None)):
        assert LayerProfile.from_json(p.to_json()) == p
    assert json.loads(_profile(8).to_json())["batch"] == 8
    with pytest.raises(ValueError, match="'batch' must be a positive int"):
        LayerProfile.from_json(json.dumps({**json.loads(_profile().to_json()), "batch": 0}))
    with pytest.raises(ValueError, match=r"layer 0 lacks fields \['forward'"):
        LayerProfile.from_json(json.dumps({"layers": [{"name": "x"}]}))


def test_plan_prints_a_table_and_writes_the_json_sw_plan_returns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    path.write_text(_profile().to_json())
    out_json, png = tmp_path / "plans.json", tmp_path / "best.png"
    code = main(
        ["plan", "--profile", str(path), "-n", "4", "--global-batch", "8", "--intra", "0.01:1e4", "--top", "3"]
        + ["--json", str(out_json), "--png", str(png)]
    )
    out = capsys.readouterr().out
    assert code == 0
    expected = sw.plan(_profile(), 4, global_batch=8, intra=Link(0.01, 1e4), top=3)
    report = json.loads(out_json.read_text())
    assert [p["step_time"] for p in report["plans"]] == [p.step_time for p in expected]
    assert [p["partition"] for p in report["plans"]] == [list(p.partition) for p in expected]
    assert report["search"]["simulated"] >= 3
    assert expected[0].schedule in out and "step s" in out and "why" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a measured compute scale: the same plans as sw.plan(..., compute_scale=(F, B)); one number scales both
    for flag, scale in ((["1.5", "2"], (1.5, 2.0)), (["1.25"], 1.25)):
        code = main(
            ["plan", "--profile", str(path), "-n", "4", "--global-batch", "8", "--intra", "0.01:1e4", "--top", "3"]
            + ["--compute-scale", *flag, "--json", str(out_json)]
        )
        assert code == 0
        scaled = sw.plan(_profile(), 4, global_batch=8, intra=Link(0.01, 1e4), top=3, compute_scale=scale)
        assert [p["step_time"] for p in json.loads(out_json.read_text())["plans"]] == [p.step_time for p in scaled]
        assert scaled[0].step_time > expected[0].step_time
    capsys.readouterr()
    assert (
        main(["plan", "--profile", str(path), "-n", "4", "--global-batch", "8", "--compute-scale", "1", "2", "3", "4"])
        == 2
    )
    assert "compute_scale" in capsys.readouterr().err


def test_plan_synthetic_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            "--synthetic",
            "blocks=4,hidden=256,seq=128,vocab=1000,heads=4,flops=4e14",
            "-n",
            "2",
            "--global-batch",
            "4",
        ]
    )
    assert code == 0 and "top" in capsys.readouterr().out
    code = main(["plan", "--synthetic", "blocks=4,width=3", "-n", "2", "--global-batch", "4"])
    assert code == 2 and "unknown key 'width'" in capsys.readouterr().err
    code = main(["plan", "--synthetic", "blocks=2,flops=4e14", "-n", "2", "--global-batch", "4", "--memory", "1B"])
    err = capsys.readouterr().err
    assert code == 2 and "no plan fits the memory cap" in err


def _plan_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, " ".join(captured.err.split())  # rich wraps long warnings


def test_the_profile_batch_comes_from_the_file_and_a_different_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file records its batch: --profile-batch may repeat it, not contradict it, and a file without one
    needs it (it used to default to 1 and scale every time by the wrong factor)."""
    path, out = tmp_path / "profile.json", tmp_path / "plans.json"
    path.write_text(_profile(batch=4).to_json())
    common = ["--profile", str(path), "-n", "2", "--global-batch", "16", "--intra", "0:inf", "--json", str(out)]
    code, _, _ = _plan_cli(common, capsys)
    assert code == 0
    expected = sw.plan(_profile(batch=None), 2, global_batch=16, profile_batch=4)
    assert [p["step_time"] for p in json.loads(out.read_text())["plans"]] == [p.step_time for p in expected]
    code, _, err = _plan_cli([*common, "--profile-batch", "1"], capsys)
    assert code == 2 and "measured on micro-batches of 4 samples" in err
    assert _plan_cli([*common, "--profile-batch", "4"], capsys)[0] == 0
    path.write_text(_profile(batch=None).to_json())
    code, _, err = _plan_cli(common, capsys)
    assert code == 2 and "--profile-batch" in err and "does not record" in err
    assert _plan_cli([*common, "--profile-batch", "4"], capsys)[0] == 0
    # the library refuses the same contradiction
    with pytest.raises(ValueError, match="profile_batch=1, but the profile was measured on micro-batches of 4"):
        sw.plan(_profile(batch=4), 2, global_batch=16, profile_batch=1)


def test_links_not_calibrated_warn_loudly_and_a_saved_calibration_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out, saved = tmp_path / "profile.json", tmp_path / "plans.json", tmp_path / "cal.json"
    path.write_text(_profile().to_json())
    common = ["--profile", str(path), "-n", "4", "--global-batch", "8", "--json", str(out)]
    code, _, err = _plan_cli(common, capsys)
    warning = json.loads(out.read_text())["warnings"]
    assert code == 0 and "links are not calibrated" in err and "--calibration" in err
    assert len(warning) == 1 and "links are not calibrated" in warning[0]
    cal = Calibration(
        intra=Link(1e-3, 1e6), action=1e-3, step=2e-3, cores=3.0, layouts=(LayoutCost(2, 2, 1, 1, 0.01),), processes=4
    )
    assert Calibration.load(cal.save(saved)) == cal
    code, _, err = _plan_cli([*common, "--calibration", str(saved)], capsys)
    assert code == 0 and "warning" not in err and json.loads(out.read_text())["warnings"] == []
    expected = sw.plan(_profile(), 4, global_batch=8, calibration=cal)
    assert [p["step_time"] for p in json.loads(out.read_text())["plans"]] == [p.step_time for p in expected]
    # a calibration measured on other processes holds for those only; --intra alone silences the link warning
    code, _, err = _plan_cli(
        ["--profile", str(path), "-n", "2", "--global-batch", "8", "--calibration", str(saved)], capsys
    )
    assert code == 0 and "measured on 4 processes" in err
    assert "warning" not in _plan_cli([*common, "--intra", "1e-4:1e9"], capsys)[2]
    saved.write_text('{"intra": [1e-4, 1e9], "colour": 1}')
    code, _, err = _plan_cli([*common, "--calibration", str(saved)], capsys)
    assert code == 2 and "unknown keys ['colour']" in err


def test_best_per_layout_lists_each_layouts_best_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = tmp_path / "profile.json", tmp_path / "plans.json"
    path.write_text(_profile().to_json())
    args = ["--profile", str(path), "-n", "4", "--global-batch", "8", "--intra", "1e-4:1e8", "--top", "20"]
    code, text, _ = _plan_cli([*args, "--best-per-layout", "--json", str(out)], capsys)
    assert code == 0 and "layouts, each with its best plan" in text
    got = json.loads(out.read_text())["plans"]
    everything = sw.plan(_profile(), 4, global_batch=8, intra=Link(1e-4, 1e8), top=100_000)
    best: dict[tuple[int, ...], float] = {}
    for p in everything:
        key = (p.layout.pp, p.layout.dp, p.layout.tp, p.layout.sharding)
        best[key] = min(best.get(key, float("inf")), p.step_time)
    layouts = [tuple(p["layout"][k] for k in ("pp", "dp", "tp", "sharding")) for p in got]
    assert len(set(layouts)) == len(layouts) == len(best)  # every layout once
    # each layout's best: its fastest, or a plan within the timing noise of it with less memory (ranking.NOISE)
    assert all(best[key] <= p["step_time"] <= best[key] * (1 + NOISE) for p, key in zip(got, layouts))


def _plan_output(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    assert main(["plan", *args]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_without_memory_the_help_and_the_output_say_there_is_no_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--help"]) == 0
    assert "default: no cap" in " ".join(capsys.readouterr().out.split())
    path = tmp_path / "profile.json"
    path.write_text(_profile().to_json())
    common = ["--profile", str(path), "-n", "4", "--global-batch", "8", "--intra", "0.01:1e4", "--top", "3"]
    out, _ = _plan_output(common, capsys)
    best = sw.plan(_profile(), 4, global_batch=8, intra=Link(0.01, 1e4), top=3)[0]
    line = " ".join(out.split())
    need = in_unit(best.peak_memory, unit_for(best.peak_memory))
    assert f"no memory cap was set (--memory): the top plan needs {need} per process" in line, out
    out, _ = _plan_output([*common, "--memory", "1GiB"], capsys)
    assert "no memory cap" not in out


def test_the_why_column_speaks_the_tables_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tied plans differ in memory only: the why column compares peaks in the unit the peak column prints them in
    (it printed bytes - "15300 B vs 15600 B" - beside a peak column of "1.42e-05" GiB)."""
    path = tmp_path / "profile.json"
    path.write_text(_profile().to_json())
    out, _ = _plan_output(["--profile", str(path), "-n", "4", "--global-batch", "8", "--top", "5"], capsys)
    rows = [[c.strip() for c in line.split("│")] for line in out.splitlines() if "lower peak memory" in line]
    assert rows, out
    for row in rows:
        peak, why = row[10], row[11]
        assert f"lower peak memory ({peak} vs " in why, row
        assert peak.split()[-1] in ("B", "KiB", "MiB", "GiB"), row


def test_a_top_plan_with_a_large_bubble_gets_a_notice_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner guide's synthetic model at 8 processes: its top plan idles its pipeline ranks ~64% of the step,
    because the head outweighs the blocks (uneven stages), not because the pipeline fills and drains."""
    spec = "blocks=8,hidden=1024,seq=512,flops=4e14"
    out, _ = _plan_output(["--synthetic", spec, "-n", "8", "--global-batch", "64", "--intra", "2e-5:2e10"], capsys)
    line = " ".join(out.split())
    assert "notice: the top plan leaves its pipeline ranks idle" in line, out
    assert "uneven" in line and "fills and drains" in line, out
    out, _ = _plan_output(["--synthetic", spec, "-n", "1", "--global-batch", "64"], capsys)
    assert "notice: the top plan" not in out  # one process: no pipeline, no bubble
