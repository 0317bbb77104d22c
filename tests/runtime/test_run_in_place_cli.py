"""``stagewise run --in-place``'s launch arguments. It lives here, not beside the other launch checks in
tests/core/test_elastic_layout.py, because the in-place watcher is torchrun's agent and loads torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagewise.cli.main import main


def test_run_in_place_gives_the_workers_the_store_and_needs_no_restarts(
    launched: tuple[Path, list[tuple[list[str], dict[str, str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    script, calls = launched
    argv = ["run", "-n", "2", "--nnodes", "2:3", "--in-place", "--rdzv-endpoint", "10.0.0.9:29400", "--rdzv-id", "j"]
    assert main([*argv, str(script)]) == 0  # no --max-restarts: nobody is restarted
    assert calls[0][1]["STAGEWISE_STORE"] == "10.0.0.9:29400"  # where sw.runtime.InPlace's workers agree on members
    assert "--max-restarts" not in " ".join(calls[0][0])
    assert main([*argv, "--rdzv-host", str(script)]) == 2
    assert "no training machine may host it: drop --rdzv-host" in capsys.readouterr().err
