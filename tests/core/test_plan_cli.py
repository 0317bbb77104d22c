"""``stagewise plan``: a table of the top plans, JSON that matches sw.plan, a PNG, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Link


def _profile() -> LayerProfile:
    times = [0.5, 1.0, 1.0, 1.0, 1.0, 2.0]
    return LayerProfile(
        tuple(LayerCost(f"l{k}", t, t, t, 2 * t, 100.0, 50.0, 1000.0, 10.0) for k, t in enumerate(times)), "cpu", 3, 1
    )


def test_profile_json_round_trips() -> None:
    p = _profile()
    assert LayerProfile.from_json(p.to_json()) == p
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
        ["plan", "--synthetic", "blocks=4,hidden=256,seq=128,vocab=1000,heads=4", "-n", "2", "--global-batch", "4"]
    )
    assert code == 0 and "top" in capsys.readouterr().out
    code = main(["plan", "--synthetic", "blocks=4,width=3", "-n", "2", "--global-batch", "4"])
    assert code == 2 and "unknown key 'width'" in capsys.readouterr().err
    code = main(["plan", "--synthetic", "blocks=2", "-n", "2", "--global-batch", "4", "--memory", "1e-9"])
    err = capsys.readouterr().err
    assert code == 2 and "no plan fits the memory cap" in err
