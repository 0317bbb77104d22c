"""The planner's table reads right (issue 51 item 6): plans within the timing noise are tied and ordered by memory,
no reason says "0.00 % faster", memory is bytes or a string with a unit in the API and the CLI alike, a column
speaks one unit, links are a Link or a (latency, bandwidth) pair, and planning with free links warns."""

from __future__ import annotations

import math
import warnings

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Link
from stagewise.planning.ranking import NOISE, ranked, with_reasons
from stagewise.planning.units import in_unit, parse_bytes, unit_for


def _profile(n: int = 6) -> LayerProfile:
    layers = [LayerCost(f"l{k}", 1.0, 1.0, 1.0, 2.0, 4e5, 2e5, 3e5, 1e3) for k in range(n)]
    return LayerProfile(tuple(layers), "synthetic", 1, 0, batch=1)


def test_sizes_take_a_unit_and_numbers_are_bytes() -> None:
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("512 MiB") == 2**29 and parse_bytes("16GB") == 16e9
    assert parse_bytes(1000) == 1000.0 and math.isinf(parse_bytes("inf"))
    with pytest.raises(ValueError, match="give a unit, e.g. 16GiB"):
        parse_bytes("16", "--memory", bare=False)
    with pytest.raises(ValueError, match="unknown unit 'GiBs'"):
        parse_bytes("1GiBs")
    assert unit_for(3 * 2**20) == "MiB" and in_unit(3 * 2**20, "MiB") == "3 MiB" and in_unit(2**19, "MiB") == "0.5 MiB"


def test_memory_and_links_in_every_form_plan_alike() -> None:
    prof = _profile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = sw.plan(prof, 2, global_batch=4, memory=8 * 2**20, intra=Link(1e-4, 1e8))
        worded = sw.plan(prof, 2, global_batch=4, memory="8MiB", intra=(1e-4, 1e8))
    assert [p.describe() for p in plain] == [p.describe() for p in worded]
    with pytest.raises(TypeError, match=r"intra must be a Link or \(latency seconds, bandwidth"):
        sw.plan(prof, 2, global_batch=4, intra=1e-4)  # type: ignore[typeddict-item]


def test_planning_with_free_links_warns_as_the_cli_does() -> None:
    with pytest.warns(UserWarning, match="links are not calibrated"):
        sw.plan(_profile(), 2, global_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.plan(_profile(), 2, global_batch=4, intra=(1e-4, 1e8))


def test_plans_within_the_noise_are_tied_and_go_by_memory() -> None:
    plans = sw.plan(_profile(), 4, global_batch=8, intra=(1e-4, 1e8), top=30)
    for a, b in zip(plans, plans[1:]):
        assert "0.0% faster" not in a.why and "0.00%" not in a.why, a.why
        if b.step_time <= a.step_time * (1 + NOISE) and a.step_time <= b.step_time * (1 + NOISE):
            assert "within the timing noise" in a.why, a.why
    first = plans[0]
    fastest = min(p.step_time for p in plans)
    tied = [p for p in plans if p.step_time <= fastest * (1 + NOISE)]
    assert first.peak_memory == min(p.peak_memory for p in tied)  # a tie goes to the smaller memory
    # a 1e-17 s difference does not outrank memory (the table)
    slow, fast = plans[0], plans[1]
    nudged = [type(fast)(**{**fast.__dict__, "step_time": slow.step_time - 1e-17})]
    order = ranked([slow, *nudged])
    assert order[0].peak_memory <= order[1].peak_memory
    assert all("vs" in p.why for p in with_reasons(order)[:1])


def test_the_cli_takes_the_same_size_strings(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(_profile().to_json())
    args = ["plan", "--profile", str(path), "-n", "2", "--global-batch", "4", "--intra", "1e-4:1e8"]
    assert main([*args, "--memory", "8MiB"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("│")] for line in out.splitlines()]
    units = {cells[10].split()[-1] for cells in rows if len(cells) > 11 and cells[1].isdigit()}
    assert len(units) == 1, out  # one unit in the peak column
    assert main([*args, "--memory", "8"]) == 2
    assert "give a unit, e.g. 8GiB" in capsys.readouterr().err
    assert main(["plan", "--synthetic", "blocks=2", "-n", "2", "--global-batch", "4"]) == 2
    assert "give flops=" in capsys.readouterr().err
