"""``stagewise simulate --json``: the times it reports are the ones it simulated (issue 33: ``b_time`` said 1
when a backward cost 2)."""

from __future__ import annotations

import json

import pytest

from stagewise.cli.main import main


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["simulate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_b_time_is_the_full_backward(capsys: pytest.CaptureFixture[str]) -> None:
    costs = report(capsys, "-s", "1f1b", "-p", "2", "-m", "2")["costs"]
    assert costs == {"f_time": 1.0, "i_time": 1.0, "b_time": 2.0, "w_time": 1.0, "comm_time": 0.0, "sync_time": 0.0}
    costs = report(capsys, "-s", "gpipe", "-p", "2", "-m", "2", "--i-time", "1.5", "--w-time", "0.25")["costs"]
    assert isinstance(costs, dict) and costs["b_time"] == 1.75


def test_the_reported_b_time_is_what_a_fused_backward_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """GPipe at p = 1 runs m forwards then m full backwards: makespan m (F + B), B the reported b_time."""
    out = report(capsys, "-s", "gpipe", "-p", "1", "-m", "3", "--f-time", "1", "--i-time", "2", "--w-time", "0.5")
    costs = out["costs"]
    assert isinstance(costs, dict)
    assert out["makespan"] == pytest.approx(3 * (costs["f_time"] + costs["b_time"]))
