"""The methods comparison (benchmarks/compare_methods.py) in a tiny configuration on 2 ranks.

One torchrun job trains every method for a few mini-batches; the tests read its
JSON and markdown and check them against references: the table's shape, every
method's losses finite, the synchronous rows equal to one-process training,
the asynchronous rows equal to ``sw.async_reference``'s replay of their version
rule, and the simulated columns equal to the closed forms of the README.
No timing is asserted (samples/s is only checked to be a positive number).
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
import torch.nn.functional as F

import stagewise as sw

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import compare_methods as cm  # noqa: E402

STEPS, BATCH, M, WINDOW, SEED, LR = 6, 32, 4, 3, 0, 0.1
TIMEOUT = 300


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("compare")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0"]
    cmd += [str(BENCH / "compare_methods.py"), "--out", str(out), f"--steps={STEPS}", f"--batch={BATCH}"]
    cmd += [f"--microbatches={M}", f"--window={WINDOW}", f"--seeds={SEED}", f"--lr={LR}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"compare_methods ran past {TIMEOUT} s:\n{err.stdout}\n{err.stderr}")
    assert done.returncode == 0, f"compare_methods exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    data = json.loads((out / "compare.json").read_text())
    data["markdown"] = (out / "compare.md").read_text()
    data["out"] = out
    return data


def _row(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in result["rows"] if r["method"] == name)


def test_every_method_ran_with_finite_losses(result: dict[str, Any]) -> None:
    assert [r["method"] for r in result["rows"]] == [m.name for m in cm.METHODS]
    for row, method in zip(result["rows"], cm.METHODS, strict=True):
        assert row["family"] == method.family
        (run,) = row["runs"]
        assert [c[0] for c in run["curve"]] == [BATCH * k for k in range(1, STEPS + 1)], row["method"]
        losses = [c[2] for c in run["curve"]] + [run["train_loss"], run["val_loss"]]
        assert all(math.isfinite(v) and v > 0 for v in losses), (row["method"], losses)
        assert 0.0 <= run["val_accuracy"] <= 1.0 and run["samples_per_s"] > 0
        assert row["verdict"], row["method"]
    for name in ("loss_vs_samples.png", "loss_vs_time.png"):
        assert (result["out"] / name).stat().st_size > 0


def test_markdown_table_has_one_row_per_method_and_every_column(result: dict[str, Any]) -> None:
    lines = result["markdown"].splitlines()
    start = lines.index(cm.HEADER)
    columns = cm.HEADER.count("|") - 1
    rows = [line for line in lines[start + 2 :] if line.startswith("|")]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [m.name for m in cm.METHODS]
    for row in rows:
        assert row.count("|") - 1 == columns, row


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x_train, y_train, _, _ = cm.load_digits()
    return cm.minibatches(x_train, y_train, STEPS, BATCH, SEED)


def test_sync_rows_match_one_process_training(result: dict[str, Any]) -> None:
    model = sw.build_model(cm.mlp_layers(), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    expected = []
    for x, y in _batches():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    for method in (m for m in cm.METHODS if m.family == "sync"):
        got = [c[2] for c in _row(result, method.name)["runs"][0]["curve"]]
        assert got == pytest.approx(expected, abs=1e-4), method.name


@pytest.mark.parametrize("method", [m for m in cm.METHODS if m.family == "async"], ids=lambda m: m.name)
def test_async_rows_match_the_one_process_replay(result: dict[str, Any], method: cm.Method) -> None:
    run = sw.async_reference(
        cm.mlp_layers(),
        method.build(2, M, WINDOW),
        lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
        _batches(),
        loss_fn=F.cross_entropy,
        seed=SEED,
    )
    got = [c[2] for c in _row(result, method.name)["runs"][0]["curve"]]
    assert got == pytest.approx(run.losses, abs=1e-4), method.name


def test_simulated_columns_follow_the_closed_forms(result: dict[str, Any]) -> None:
    p = cm.SIM_RANKS
    assert _row(result, "1f1b")["sim_bubble"] == pytest.approx((p - 1) / (M + p - 1))
    assert _row(result, "gpipe")["versions"] == [1] * p
    stash = [1 + math.ceil((p - s - 1) / M) for s in range(p)]
    assert _row(result, "pipedream (stashing)")["versions"] == stash
    assert _row(result, "pipedream (stashing + vertical sync)")["versions"] == [1 + math.ceil((p - 1) / M)] * p
    assert _row(result, "pipedream (no stashing)")["versions"] == [1] * p
    assert _row(result, "pipedream-2bw")["versions"] == [2] * p
    assert _row(result, "xpipe")["versions"] == [2 + math.ceil((p - s - 1) / M) for s in range(p - 1)] + [1]
    n = WINDOW * M  # an asynchronous window drains once: bubble (p - 1) / (N m + p - 1)
    assert _row(result, "pipedream (stashing)")["sim_bubble"] == pytest.approx((p - 1) / (n + p - 1))
    assert _row(result, "1f1b")["activations"] == [min(M, p - s) for s in range(p)]
