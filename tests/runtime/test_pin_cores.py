"""``stagewise run --pin-cores``: each local rank on its own share of the cores (stagewise.runtime.measure.cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagewise.runtime.measure.cores as cores_module
from stagewise.cli.main import main
from stagewise.runtime.measure.cores import core_sets, pin_local_rank


def test_each_rank_gets_an_equal_disjoint_share_of_the_cores() -> None:
    assert core_sets(2, [1, 0]) == [[0], [1]]
    assert core_sets(2, [6, 4, 5, 7]) == [[4, 5], [6, 7]]
    assert core_sets(2, [0, 1, 2]) == [[0], [1]]  # the odd core left to the rest of the machine
    assert core_sets(3, range(8)) == [[0, 1], [2, 3], [4, 5]]
    assert core_sets(1, [3, 5]) == [[3, 5]]


def test_more_ranks_than_cores_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"3 processes on 2 cores \(0, 1\): each rank needs a core of its own"):
        core_sets(3, [0, 1])
    with pytest.raises(ValueError, match="local ranks must be >= 1"):
        core_sets(0, [0, 1])


def test_the_local_rank_is_pinned_to_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, set[int]]] = []
    monkeypatch.setattr(cores_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cores_module.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, set(cpus))))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pin_local_rank() == [2, 3]
    assert calls == [(0, {2, 3})]
    with pytest.raises(ValueError, match="local rank 2 is not one of 2"):
        pin_local_rank(2, 2)


def test_the_script_runs_as_main_on_its_core(tmp_path: Path) -> None:
    here = sorted(os.sched_getaffinity(0))
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\nif __name__ == '__main__':\n    print(sorted(os.sched_getaffinity(0)), sys.argv)\n"
    )
    env = {**os.environ, "LOCAL_RANK": str(len(here) - 1), "LOCAL_WORLD_SIZE": str(len(here))}
    done = subprocess.run([sys.executable, "-m", "stagewise.runtime.measure.cores", str(script), "a", "--b"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{here[-1]}] {[str(script), 'a', '--b']}"
    env["LOCAL_WORLD_SIZE"] = str(len(here) + 1)
    env["LOCAL_RANK"] = "0"
    refused = subprocess.run([sys.executable, "-m", "stagewise.runtime.measure.cores", str(script)],
                             env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "each rank needs a core of its own" in refused.stderr


def test_run_pin_cores_launches_through_the_pinning_module(
    launched: tuple[Path, list[tuple[list[str], dict[str, str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    script, calls = launched
    assert main(["run", "-n", "1", "--pin-cores", str(script), "x"]) == 0
    argv = calls[0][0]
    assert argv[-4:] == ["-m", "stagewise.runtime.measure.cores", str(script), "x"]
    assert main(["run", "-n", "1", str(script)]) == 0
    assert "stagewise.runtime.measure.cores" not in calls[1][0]
    too_many = len(os.sched_getaffinity(0)) + 1
    assert main(["run", "-n", str(too_many), "--pin-cores", str(script)]) == 2
    assert f"--pin-cores: {too_many} processes on" in capsys.readouterr().err
    assert len(calls) == 2  # refused before anything started
