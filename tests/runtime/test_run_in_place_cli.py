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


def test_in_place_without_a_range_of_sizes_is_refused(
    launched: tuple[Path, list[tuple[list[str], dict[str, str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--in-place`` with a fixed ``--nnodes`` (or none) was accepted and ignored: the job ran as a fixed one."""
    script, calls = launched
    assert main(["run", "-n", "2", "--in-place", str(script)]) == 2
    assert "--in-place keeps the survivors' processes when a machine is lost, which needs --nnodes MIN:MAX" in (
        capsys.readouterr().err
    )
    assert calls == []  # nothing launched


def test_a_file_a_command_writes_gets_its_folder(tmp_path: Path) -> None:
    """``plan --json`` / ``simulate --png`` into a folder not made yet: made (a FileNotFoundError traceback before)."""
    out = tmp_path / "new" / "deeper" / "sim.png"
    assert main(["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--png", str(out)]) == 0
    assert out.is_file()


def test_a_misspelt_compare_workload_is_refused_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """``stagewise compare --workload gtp`` launched the ranks, and each refused it: the choices are the CLI's now,
    the benchmark's own (held alike here)."""
    from benchmarks.compare.__main__ import parse_args
    from benchmarks.compare.workloads import WORKLOADS

    from stagewise.cli.compare import WINDOW
    from stagewise.cli.compare import WORKLOADS as CHOICES

    assert tuple(sorted(WORKLOADS)) == CHOICES
    assert parse_args([]).window == WINDOW  # the CLI refuses --steps that are no whole windows
    assert main(["compare", "--workload", "gtp"]) == 2
    assert "invalid choice: 'gtp'" in capsys.readouterr().err


def test_rendezvous_on_a_port_held_by_another_program_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A port in use gave torch's DistNetworkError traceback (EADDRINUSE); now one line, exit 2."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["rendezvous", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot host the store at 127.0.0.1:{port}: " in err and "--port 0 picks a free one" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
