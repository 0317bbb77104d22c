"""The methods comparison (``python -m benchmarks.compare``) in a tiny configuration on 2 ranks, both workloads.

One torchrun job trains every method for one window on the GPT and the CNN;
the tests read its JSON and markdown and check them against references: the
tables' shape, every method's losses finite, the synchronous rows equal to
one-process training, the asynchronous rows equal to ``async_reference``'s
replay of their version rule, the memory columns against the model's
parameter bytes, and the verdict rule against its definition. No timing is
asserted (samples/s is only checked to be a positive number).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.compare import methods as cm
from benchmarks.compare import report
from benchmarks.compare.costs import SIM_RANKS
from benchmarks.compare.workloads import workload

import stagewise as sw
from oracles.async_reference import async_reference

ROOT = Path(__file__).resolve().parents[2]

STEPS, BATCH, M, WINDOW, SEED, LR = 3, 16, 4, 3, 0, 0.1
#: `make compare` (STAGEWISE_COMPARE_ALL=1) runs this module on both models; `make test` leaves it to that target (30 s
#: of CI's time on 2 cores: the methods it compares are the library's schedules, whose parity against one process
#: and against the replay of their rules tests/distributed checks; test_benchmark_help.py imports the benchmark)
WORKLOADS = ("gpt", "cnn")
TIMEOUT = 800
pytestmark = [
    pytest.mark.timeout(TIMEOUT + 60),  # one job for the module; ~40 s of CPU, far longer on a loaded machine
    pytest.mark.skipif(
        not os.environ.get("STAGEWISE_COMPARE_ALL"), reason="the methods comparison's run: `make compare`"
    ),
]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("compare")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    cmd += ["-m", "benchmarks.compare", "--out", str(out), f"--steps={STEPS}", f"--batch={BATCH}"]
    cmd += [f"--microbatches={M}", f"--window={WINDOW}", f"--seeds={SEED}", f"--lr={LR}", "--workload", *WORKLOADS]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # the ranks import benchmarks
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"benchmarks.compare ran past {TIMEOUT} s:\n{err.stdout}\n{err.stderr}")
    assert done.returncode == 0, f"benchmarks.compare exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    data = {name: json.loads((out / name / "compare.json").read_text()) for name in WORKLOADS}
    for name in WORKLOADS:
        data[name]["markdown"] = (out / name / "compare.md").read_text()
    data["out"] = out
    return data


ALL = cm.all_methods()  # METHODS and the rows of EXTRA_METHOD_MODULES (HetPipe's)


def _row(result: dict[str, Any], name: str, method: str) -> dict[str, Any]:
    return next(r for r in result[name]["rows"] if r["method"] == method)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_method_ran_with_finite_losses(result: dict[str, Any], name: str) -> None:
    assert [r["method"] for r in result[name]["rows"]] == [m.name for m in ALL]
    assert len(ALL) > len(cm.METHODS)  # HetPipe's rows are in
    for row, method in zip(result[name]["rows"], ALL, strict=True):
        assert row["family"] == method.family
        (run,) = row["runs"]
        samples = [c[0] for c in run["curve"]]
        if method.run is None:
            assert samples == [BATCH * k for k in range(1, STEPS + 1)], row["method"]
        else:  # HetPipe: per wave, two VWs on equal halves
            assert samples == sorted(samples) and samples[-1] == BATCH * (STEPS // 2 * 2), (row["method"], samples)
        losses = [c[2] for c in run["curve"]] + [run["train_loss"], run["val_loss"]]
        assert all(math.isfinite(v) and v > 0 for v in losses), (row["method"], losses)
        assert 0.0 <= run["val_accuracy"] <= 1.0 and run["samples_per_s"] > 0
        assert 0.0 <= row["sim_bubble"] < 1.0 and row["sim_throughput"] > 0 and row["verdict"]
    for png in ("loss_vs_samples", "loss_vs_time", "timelines_measured", "timelines_simulated"):
        assert (result["out"] / name / f"{png}.png").stat().st_size > 0
    assert f"**{name}**" in (result["out"] / "compare.md").read_text()


@pytest.mark.parametrize("name", WORKLOADS)
def test_markdown_tables_have_one_row_per_method_and_every_column(result: dict[str, Any], name: str) -> None:
    lines = result[name]["markdown"].splitlines()
    for header in (report.HEADER, report.MEMORY_HEADER):
        start = lines.index(header)
        columns = header.count("|") - 1
        rows = []
        for line in lines[start + 2 :]:
            if not line.startswith("|"):
                break
            rows.append(line)
        assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [m.name for m in ALL]
        assert all(row.count("|") - 1 == columns for row in rows), header


def _parameter_bytes(name: str) -> int:
    return sum(p.numel() * p.element_size() for p in sw.build_model(workload(name).layers(), 0).parameters())


@pytest.mark.parametrize("name", WORKLOADS)
def test_memory_columns_add_up_to_the_model(result: dict[str, Any], name: str) -> None:
    total = _parameter_bytes(name)
    for row in result[name]["rows"]:
        mem, sim = row["memory"], row["sim_memory"]
        if row["method"].startswith("hetpipe"):  # each VW (one rank) holds the whole model; at p = 4, pp2 each
            assert mem["weights"] == [total, total] and sum(sim["weights"]) == pytest.approx(2 * total)
            continue
        assert sum(mem["weights"]) == total and sum(sim["weights"]) == pytest.approx(total), row["method"]
        assert len(mem["weights"]) == 2 and len(sim["weights"]) == SIM_RANKS
        if row["family"] == "sync":
            assert mem["versions"] == [0, 0] and mem["activations_source"] == "measured"
            assert all(a > 0 for a in mem["activations"]), row["method"]
        else:  # the version store runs forwards on snapshots: at least one copy of each rank's weights
            assert all(v >= w for v, w in zip(mem["versions"], mem["weights"], strict=True)), row["method"]
            assert mem["activations_source"] == "sim"
        extra = [(n - 1) * w for n, w in zip(row["versions"], sim["weights"], strict=True)]
        assert sim["versions"] == pytest.approx(extra), row["method"]


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return workload(name).train(STEPS, BATCH, SEED)


@pytest.mark.parametrize("name", WORKLOADS)
def test_sync_rows_match_one_process_training(result: dict[str, Any], name: str) -> None:
    wl = workload(name)
    model = sw.build_model(wl.layers(), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    expected = []
    for x, y in _batches(name):
        opt.zero_grad()
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    for method in (m for m in cm.METHODS if m.family == "sync"):
        got = [c[2] for c in _row(result, name, method.name)["runs"][0]["curve"]]
        assert got == pytest.approx(expected, abs=1e-4), method.name


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("method", [m for m in cm.METHODS if m.family == "async"], ids=lambda m: m.name)
def test_async_rows_match_the_one_process_replay(result: dict[str, Any], name: str, method: cm.Method) -> None:
    wl = workload(name)
    run = async_reference(
        wl.layers(),
        method.build(2, M, WINDOW),
        lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
        _batches(name),
        loss_fn=wl.loss_fn,
        seed=SEED,
    )
    got = [c[2] for c in _row(result, name, method.name)["runs"][0]["curve"]]
    assert got == pytest.approx(run.losses, abs=1e-4), method.name


def test_simulated_columns_follow_the_closed_forms(result: dict[str, Any]) -> None:
    p = SIM_RANKS
    row = lambda method: _row(result, "cnn", method)  # noqa: E731
    assert row("gpipe")["versions"] == [1] * p
    stash = [1 + math.ceil((p - s - 1) / M) for s in range(p)]
    assert row("pipedream (stashing)")["versions"] == stash
    assert row("pipedream (stashing + vertical sync)")["versions"] == [1 + math.ceil((p - 1) / M)] * p
    assert row("pipedream (no stashing)")["versions"] == [1] * p
    assert row("pipedream-2bw")["versions"] == [2] * p
    assert row("xpipe")["versions"] == [2 + math.ceil((p - s - 1) / M) for s in range(p - 1)] + [1]
    assert row("1f1b")["activations"] == [min(M, p - s) for s in range(p)]
    costs = sw.CostModel.from_dict(result["cnn"]["profiled"]["costs"])  # the simulator on the profiled costs
    again = sw.simulate(sw.build_schedule("1f1b", p, M), costs)
    assert row("1f1b")["sim_bubble"] == pytest.approx(again.bubble_ratio)
    assert row("1f1b")["sim_throughput"] == pytest.approx(M * (BATCH / M) / again.makespan)


def test_verdict_counts_the_seed_spread() -> None:
    assert report.loss_verdict(1.0, 0.0, 1.0, 0.0) == "loss as synchronous training"
    assert report.loss_verdict(1.01, 0.2, 1.0, 0.0).startswith("loss unclear")  # the old rule said "as synchronous"
    assert report.loss_verdict(1.5, 0.01, 1.0, 0.01).startswith("converges worse")
    assert report.loss_verdict(1.5, 0.3, 1.0, 0.01).startswith("loss unclear")
    assert report.loss_verdict(0.5, 0.01, 1.0, 0.01).startswith("converges better")
    assert report.loss_verdict(1.04, 0.004, 1.0, 0.0) == "loss as synchronous training"
    assert report.loss_verdict(1.0, 0.06, 1.0, 0.0).startswith("loss unclear")
    assert report.loss_verdict(1.3, 0.3, 1.0, 0.02).startswith("loss unclear")  # the first rule: "as synchronous"
    assert report.loss_verdict(1.0, 0.088, 1.0, 0.088) == "loss as synchronous training"
    assert report.loss_verdict(math.nan, math.nan, 1.0, 0.1).startswith("diverged")


def test_rows_from_another_module_are_appended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "extra_rows.py").write_text(
        "from benchmarks.compare import methods as cm\n"
        "COMPARE_METHODS = [cm.Method('extra', 'sync', cm.METHODS[1].build)]\n"
    )
    (tmp_path / "clash_rows.py").write_text(
        "from benchmarks.compare import methods as cm\n"
        "COMPARE_METHODS = [cm.Method('1f1b', 'sync', cm.METHODS[1].build)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [m.name for m in cm.all_methods(["extra_rows"])] == [m.name for m in ALL] + ["extra"]
    with pytest.raises(ValueError, match="unique"):
        cm.all_methods(["clash_rows"])


def test_the_verdicts_reference_is_the_rows_that_train_as_one_process() -> None:
    build = cm.METHODS[1].build
    methods = [
        cm.Method("sync", "sync", build),
        cm.Method("dp-like", "sync", build, reference=False),  # HetPipe's D = 0: another training
        cm.Method("stale", "async", build),
    ]
    sim = {"bubble": 0.3, "throughput": 1.0, "versions": [1], "activations": [1], "memory": {}}

    def runs(losses: list[float]) -> list[dict[str, Any]]:
        return [
            {"curve": [(16, 1.0, v)], "samples_per_s": 1.0, "train_loss": v, "val_loss": v, "val_accuracy": 0.5,
             "memory": {}}
            for v in losses
        ]  # fmt: skip

    by_name = {"sync": runs([1.00, 1.02, 0.98]), "dp-like": runs([3.0, 3.1, 2.9]), "stale": runs([1.5, 1.52, 1.48])}
    rows = report.summarise(methods, by_name, {m.name: sim for m in methods}, target=0.1)
    verdicts = {r["method"]: r["verdict"] for r in rows}
    assert "converges worse (val loss +0.500" in verdicts["stale"]  # against 1.0, not the mean with dp-like
    assert "converges worse" in verdicts["dp-like"] and "as synchronous" in verdicts["sync"]
