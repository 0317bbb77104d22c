"""The ``stagewise`` command line: schedules, simulate, run, compare's hand-over, --version; bad arguments exit 2
with one line. (The console script and an installed wheel: tests/system/test_cli_installed.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import stagewise as sw
import stagewise._util
from stagewise.cli.main import main


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedules_lists_every_registered_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "schedules")
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == sw.schedule_names()
    gpipe = next(line for line in lines if line.startswith("gpipe "))
    assert sw.schedule_info("gpipe").summary in gpipe and "(p-1)/(m+p-1)" in gpipe


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["schedule"] == "1f1b"
    assert (report["ranks"], report["microbatches"], report["virtual_stages"]) == (4, 8, 1)
    assert report["makespan"] == (8 + 4 - 1) * 3.0  # F = I = W = 1
    assert report["bubble_ratio"] == pytest.approx(3 / 11)
    assert report["peak_activations"] == [4, 3, 2, 1]


def test_i_time_is_the_input_gradient_and_b_is_i_plus_w(capsys: pytest.CaptureFixture[str]) -> None:
    def makespan(*times: str) -> float:
        code, out, _ = run_main(capsys, "simulate", "-s", "gpipe", "-p", "3", "-m", "5", "--json", *times)
        assert code == 0
        return float(json.loads(out)["makespan"])

    assert makespan("--f-time", "1", "--i-time", "1.5", "--w-time", "0.5") == 7 * 3.0
    assert makespan("--f-time", "1", "--i-time", "2", "--w-time", "0") == 7 * 3.0
    assert makespan("--f-time", "1", "--i-time", "0.5", "--w-time", "0.5") == 7 * 2.0
    # GPipe pays the transfer on each of the p-1 links once each way
    assert makespan("--comm-time", "0.25") == 7 * 3.0 + 2 * 2 * 0.25


def test_virtual_stages_split_the_rank_time(capsys: pytest.CaptureFixture[str]) -> None:
    multi = [n for n in sw.schedule_names() if sw.schedule_info(n).default_virtual_stages > 1]
    if not multi:
        pytest.skip("no registered schedule with several stages per rank yet")
    name = multi[0]
    v = sw.schedule_info(name).default_virtual_stages
    p, m = 4, 8
    code, out, err = run_main(capsys, "simulate", "-s", name, "-p", str(p), "-m", str(m), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["virtual_stages"] == v
    # a rank does m micro-batches of F + I + W = 3 in all, whatever v is
    busy = p * m * 3.0
    assert 1 - busy / (p * report["makespan"]) == pytest.approx(report["bubble_ratio"])


def test_simulate_summary_ascii_and_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png, trace = tmp_path / "g.png", tmp_path / "g.json"
    code, out, _ = run_main(
        capsys, "simulate", "-s", "gpipe", "-p", "2", "-m", "2", "--ascii", "--png", str(png), "--trace", str(trace)
    )
    assert code == 0
    assert "makespan   9" in out and "bubble     33.3%" in out
    assert "rank 0  F0 F1 .  .  .  B0--- B1---" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 2 * 2 + 2  # F and B per rank and micro-batch, one SYNC each


def test_every_file_a_command_writes_gets_its_folder_made(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper"
    argv = [
        "simulate",
        "-s",
        "1f1b",
        "-p",
        "2",
        "-m",
        "2",
        "--png",
        str(out / "g.png"),
        "--torch-csv",
        str(out / "t.csv"),
    ]
    code, printed, _ = run_main(capsys, *argv)
    assert code == 0 and (out / "g.png").exists()
    assert (out / "t.csv").read_text().startswith(
        "0F0,0F1,0B0,0B1"
    ) and f"wrote torch compute_only CSV: {out / 't.csv'}" in printed


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["-s", "nope", "-p", "4", "-m", "8"], "unknown schedule 'nope'"),
        (["-s", "1f1b", "-p", "4", "-m", "8", "-v", "2"], "needs virtual_stages = 1"),
        (["-s", "1f1b", "-p", "4", "-m", "0"], "--microbatches must be >= 1, got 0"),
        (["-s", "1f1b", "-p", "0", "-m", "4"], "--ranks must be >= 1, got 0"),
        (["-s", "1f1b", "-p", "4", "-m", "4", "--f-time", "-1"], "--f-time must be a finite number >= 0"),
        (["-s", "1f1b", "-p", "4", "-m", "4", "--comm-time", "inf"], "--comm-time must be a finite number >= 0"),
    ],
)
def test_bad_simulate_arguments_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    code, out, err = run_main(capsys, "simulate", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and reason in err
    assert err.startswith("stagewise simulate: error:") and "Traceback" not in err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-p", "4")
    assert code == 2 and "--microbatches" in err
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-m", "4")
    assert code == 2 and "--ranks/-p is required" in err
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-p", "four", "-m", "2")
    assert code == 2 and "invalid int value" in err
    assert run_main(capsys)[0] == 2


def test_run_hands_over_to_torchrun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    calls: list[list[str]] = []
    import stagewise.runtime.launch as launch

    monkeypatch.setattr(launch, "torchrun", lambda argv: calls.append(argv) or 0)
    assert main(["run", "-n", "3", "--", str(script), "--lr", "0.1"]) == 0
    assert main(["run", "-n", "2", str(script), "--steps", "5", "--", "x"]) == 0
    assert calls == [
        ["--standalone", "--nproc-per-node=3", str(script), "--lr", "0.1"],
        ["--standalone", "--nproc-per-node=2", str(script), "--steps", "5", "--", "x"],
    ]


def test_run_metrics_sets_the_workers_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--metrics DIR``: every pipeline without ``metrics=`` writes there (the variable the options read)."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    calls: list[tuple[list[str], dict[str, str]]] = []
    import stagewise.runtime.launch as launch

    monkeypatch.setattr(launch, "torchrun", lambda argv, env: calls.append((argv, env)) or 0)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "-n", "2", "--metrics", "runs/a", str(script)]) == 0
    assert calls == [
        (["--standalone", "--nproc-per-node=2", str(script)], {"STAGEWISE_METRICS": str(tmp_path / "runs/a")})
    ]


def test_run_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_main(capsys, "run", "-n", "2", str(tmp_path / "missing.py"))
    assert code == 2 and "is not a file" in err
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    code, _, err = run_main(capsys, "run", "-n", "0", str(script))
    assert code == 2 and "-n must be >= 1" in err


def test_simulate_with_a_cost_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from stagewise.simulation import CostModel

    costs = CostModel.uniform(3, forward=1.0, backward_input=2.0, backward_weight=0.0)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    code, out, _ = run_main(capsys, "simulate", "-s", "1f1b", "-p", "3", "-m", "4", "--costs", str(path), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["makespan"] == 6 * 3.0 and report["costs"] == {"file": str(path)}
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-p", "4", "-m", "4", "--costs", str(path))
    assert code == 2 and "--costs describes 3 stages" in err
    path.write_text("[1, 2]")
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-p", "3", "-m", "4", "--costs", str(path))
    assert code == 2 and "expected a JSON object" in err
    code, _, err = run_main(capsys, "simulate", "-s", "1f1b", "-p", "3", "-m", "4", "--costs", str(tmp_path / "no"))
    assert code == 2 and "--costs" in err and len(err.strip().splitlines()) == 1


def test_old_flag_spellings_still_work_but_are_not_advertised(capsys: pytest.CaptureFixture[str]) -> None:
    """--stages (meant ranks) and --b-time (meant I) stay for a release as hidden aliases of --ranks / --i-time."""
    new_args = ["-s", "zb-h1", "--ranks", "3", "-m", "5", "--i-time", "1.5", "--json"]
    old_args = ["-s", "zb-h1", "--stages", "3", "-m", "5", "--b-time", "1.5", "--json"]
    code, new, _ = run_main(capsys, "simulate", *new_args)
    assert code == 0
    code, old, _ = run_main(capsys, "simulate", *old_args)
    assert code == 0
    assert json.loads(old) == json.loads(new)
    assert json.loads(new)["costs"]["i_time"] == 1.5
    code, out, _ = run_main(capsys, "simulate", "--help")
    assert code == 0
    assert "--ranks" in out and "--i-time" in out
    assert "--stages" not in out and "--b-time" not in out


def test_version_is_the_installed_distributions(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    code, out, err = run_main(capsys, "--version")
    assert (code, out, err) == (0, f"stagewise {importlib.metadata.version('stagewise')}\n", "")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"stagewise": "7.7.7"}[name])
    assert run_main(capsys, "--version")[:2] == (0, "stagewise 7.7.7\n")  # the metadata's, not __version__


def test_version_falls_back_to_the_source_tree(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Imported from a source tree that was never installed, the package's own ``__version__`` is printed."""
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setattr(stagewise._util, "VERSION", "9.8.7")
    assert run_main(capsys, "--version")[:2] == (0, "stagewise 9.8.7\n")


ROOT = Path(__file__).resolve().parents[2]


def test_compare_hands_the_benchmark_module_to_torchrun(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """From a source checkout: N ranks of ``-m benchmarks.compare`` with its options, the checkout importable from any
    working directory."""
    import stagewise.runtime.launch as launch

    calls: list[tuple[list[str], str]] = []
    monkeypatch.setattr(launch, "torchrun", lambda argv: calls.append((argv, os.environ["PYTHONPATH"])) or 0)
    monkeypatch.setenv("PYTHONPATH", "before")
    monkeypatch.chdir(tmp_path)
    argv = ["compare", "-n", "3", "--workload", "cnn", "--steps", "8", "--seeds", "0", "1", "--", "--window", "4"]
    assert main(argv) == 0
    options = ["--out", "out/compare", "--workload", "cnn", "--steps", "8", "--seeds", "0", "1", "--window", "4"]
    assert calls == [
        (["--standalone", "--nproc-per-node=3", "-m", "benchmarks.compare", *options], f"{ROOT}{os.pathsep}before")
    ]


def test_compare_without_a_checkout_exits_2_saying_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As from a wheel: neither the installed package's tree nor the working directory holds benchmarks/compare."""
    import stagewise.cli.compare as compare
    import stagewise.runtime.launch as launch

    monkeypatch.setattr(compare, "__file__", str(tmp_path / "site-packages" / "stagewise" / "cli" / "compare.py"))
    monkeypatch.setattr(launch, "torchrun", lambda argv: pytest.fail("started ranks without a checkout"))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "compare", "-n", "2")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("stagewise compare: error:") and "source checkout" in err and str(tmp_path) in err
    monkeypatch.chdir(ROOT)  # the working directory is a checkout: found there
    assert compare.find_checkout() == ROOT
    partial = tmp_path / "partial"  # benchmarks/ copied without examples/: named, not a traceback in every rank
    (partial / compare.MARKER).parent.mkdir(parents=True)
    (partial / compare.MARKER).write_text("")
    monkeypatch.chdir(partial)
    code, _, err = run_main(capsys, "compare", "-n", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{partial} holds benchmarks/compare/ without examples/digits_cnn.py, examples/gpt_data.py" in err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["-n", "1"], "-n must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "5"], "--steps (5) must be a multiple of the benchmark's window (8 mini-batches"),
        (["--steps", "8", "--", "--window", "3"], "--steps (8) must be a multiple of the benchmark's window (3 "),
        (["--steps", "6", "--", "--window=4"], "--steps (6) must be a multiple of the benchmark's window (4 "),
    ],
)
def test_bad_compare_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], reason: str) -> None:
    code, _, err = run_main(capsys, "compare", *argv)
    assert code == 2 and reason in err and len(err.strip().splitlines()) == 1


def test_the_usage_lines_show_what_is_required_and_the_top_help_lists_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_main(capsys, "simulate", "--help")
    usage = " ".join(out.split("\n\n")[0].split())
    assert code == 0 and "(--schedule NAME | --from-torch CLASS) --ranks P --microbatches M" in usage, usage
    code, out, _ = run_main(capsys, "--help")
    head = " ".join(out.split("positional arguments")[0].split())
    assert code == 0
    for command in ("schedules", "simulate", "run", "plan", "compare"):
        assert command in head, head  # the description names every command, not only the first four
