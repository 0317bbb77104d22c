"""The examples, run the way a user runs them (``stagewise run -n N examples/...``), tiny and short.

Each run is a subprocess under torch's launcher with a timeout; the tests check
that the outputs exist, that the loss falls, that the checkpoint loads into the
one-process model, and that ``--single`` computes what the pipeline computes.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gpt_stdlib  # examples/ is on pytest's pythonpath
import reporting
import stagewise as sw
from gpt_data import eval_batches, split, stdlib_corpus
from gpt_model import GPTConfig, gpt_layers, lm_loss
from stagewise.runtime.reporting.files import read_metrics, series
from stagewise.runtime.reporting.sinks import tensorboard_installed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

TINY_GPT = (
    "--steps=16",
    "--layers=2",
    "--d-model=32",
    "--heads=2",
    "--seq-len=32",
    "--batch-size=8",
    "--microbatches=4",
    "--lr=1e-2",
    "--warmup=4",
    "--eval-every=8",
    "--eval-batches=2",
    "--timeline-every=4",
    "--sample=16",
    "--no-progress",
)
TIMEOUT = 180  # seconds per run; a tiny run takes 10-20 s, most of it starting processes


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT} s:\n{err.stdout}\n{err.stderr}")
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{log[-6000:]}"
    return log


def stagewise_run(nproc: int, script: str, *args: str, cwd: Path) -> str:
    """``stagewise run -n NPROC examples/SCRIPT ARGS``, with the installed console script when there is one."""
    exe = Path(sys.executable).with_name("stagewise")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "stagewise.cli.main"]
    return _run([*launcher, "run", "-n", str(nproc), str(EXAMPLES / script), *args], cwd)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpt") / "demo"
    log = stagewise_run(4, "gpt_stdlib.py", *TINY_GPT, f"--out={out}", cwd=out.parent)
    return out, log


def test_gpt_on_4_ranks_writes_every_output(gpt_run: tuple[Path, str]) -> None:
    out, log = gpt_run
    for name in ("loss_curve.png", "timeline_measured.png", "timeline_simulated.png", "timeline_compare.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    for name in ("timeline_measured.trace.json", "timeline_simulated.trace.json"):
        trace = json.loads((out / name).read_text())
        ranks = {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert ranks == {0, 1, 2, 3}, name
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(17))
    assert "stagewise: GPT on the Python standard library" in log and "bubble" in log


def test_gpt_loss_falls_and_the_bubble_is_measured(gpt_run: tuple[Path, str]) -> None:
    summary = json.loads((gpt_run[0] / "summary.json").read_text())
    assert summary["first_val_loss"] > 5.0  # about ln 256 = 5.55 (a uniform guess) before training, a bit less
    # with the tied head, which starts out guessing the input byte again (a quarter of the bytes repeat)
    assert summary["final_val_loss"] < summary["first_val_loss"] - 1.0
    assert summary["final_train_loss"] < summary["first_loss"] - 1.0
    assert 0 < summary["bubble_simulated"] < 1 and 0 < summary["bubble_measured"] < 1


def _gpt_checkpoint(out: Path) -> tuple[GPTConfig, torch.nn.Module, Any]:
    """The example's last checkpoint, loaded into the one-process model (this process has no process group)."""
    last = sw.checkpoint.latest(out / "checkpoints")
    assert last is not None and last.name == "step-00000016"
    probe = json.loads((last / "stagewise.json").read_text())["extra"]
    cfg = GPTConfig(**probe["config"])
    model = sw.build_model(gpt_layers(cfg), seed=probe["seed"] + 7)
    info = sw.checkpoint.load(last, model)  # strict: every parameter of every stage, under its one-process name
    return cfg, model, info


def test_gpt_checkpoint_loads_into_the_one_process_model(gpt_run: tuple[Path, str]) -> None:
    out = gpt_run[0]
    cfg, model, info = _gpt_checkpoint(out)
    assert info.step == 16 and info.layout["pipeline"]["ranks"] == 4 and info.extra["batches_drawn"] == 16
    _, valid = split(stdlib_corpus())
    with torch.no_grad():
        x, y = eval_batches(valid, 8, cfg.seq_len, 2)[0]
        assert float(lm_loss(model(x), y)) < 4.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000016"]  # --keep 2, one save


@pytest.mark.skipif(not os.environ.get("STAGEWISE_FAULTS"), reason="three more runs of the example: `make faults`")
def test_gpt_resumes_from_its_checkpoint_bit_exactly(gpt_run: tuple[Path, str], tmp_path: Path) -> None:
    """Stopped after step 8 and started again (fresh processes): steps 9-16 lose exactly what the uninterrupted run
    lost (same layout, float32 on CPU), because the model, AdamW's state, RNG and data position come back."""
    out = tmp_path / "demo"
    stagewise_run(4, "gpt_stdlib.py", *TINY_GPT, f"--out={out}", "--save-every=4", "--stop-at=8", cwd=tmp_path)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    single = shutil.copytree(out, tmp_path / "single")  # the same checkpoint, resumed in one process below
    log = stagewise_run(4, "gpt_stdlib.py", *TINY_GPT, f"--out={out}", "--save-every=4", cwd=tmp_path)
    assert "resuming from" in log and "step 8" in log

    def losses(folder: Path) -> dict[int, str]:
        return {int(r["step"]): r["loss"] for r in csv.DictReader((folder / "metrics.csv").open()) if r["loss"]}

    resumed, uninterrupted = losses(out), losses(gpt_run[0])
    assert sorted(resumed) == list(range(1, 17))  # the stopped run's steps kept in metrics.csv, the rest after them
    assert resumed == uninterrupted
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000012", "step-00000016"]
    # another layout: the 4-stage checkpoint resumed by the one-process model (float rounding differs)
    log = _run([sys.executable, str(EXAMPLES / "gpt_stdlib.py"), "--single", *TINY_GPT, f"--out={single}"], tmp_path)
    assert "resuming from" in log
    moved = {k: float(v) for k, v in losses(single).items()}
    assert sorted(moved) == list(range(1, 17))
    assert [moved[k] for k in range(9, 17)] == pytest.approx([float(uninterrupted[k]) for k in range(9, 17)], abs=2e-2)


def test_gpt_head_is_tied_to_the_token_embedding(gpt_run: tuple[Path, str]) -> None:
    """GPT-2's weight tying: one (vocabulary x width) matrix, saved once, and the head computes with it."""
    cfg, model, _ = _gpt_checkpoint(gpt_run[0])
    record = json.loads((sw.checkpoint.latest(gpt_run[0] / "checkpoints") / "stagewise.json").read_text())
    shape = [cfg.vocab_size, cfg.d_model]
    matrices = [k for k, v in record["tensors"].items() if k.startswith("model/") and v["shape"] == shape]
    assert matrices == ["model/tokens.weight"]  # saved once, though two ranks hold it
    assert not [k for k in record["tensors"] if k.startswith("model/head.")]
    assert [n for n, _ in model.named_parameters() if n.startswith("head.")] == []
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = x
        for name, layer in model.named_children():  # everything before the head: the normed last hidden state
            if name == "head":
                break
            h = layer(h)
        logits = model.head(h)
        torch.testing.assert_close(logits, h @ model.tokens.weight.T / cfg.d_model**0.5)
        model.tokens.weight.mul_(2.0)  # the head reads the embedding's own tensor, not a copy of it
        torch.testing.assert_close(model.head(h), 2.0 * logits)


def test_single_process_run_computes_what_the_pipeline_computes(gpt_run: tuple[Path, str], tmp_path: Path) -> None:
    _run([sys.executable, str(EXAMPLES / "gpt_stdlib.py"), "--single", *TINY_GPT, f"--out={tmp_path}"], tmp_path)

    def losses(out: Path) -> list[float]:
        return [float(r["loss"]) for r in csv.DictReader((out / "metrics.csv").open()) if r["loss"]]

    pipelined, single = losses(gpt_run[0]), losses(tmp_path)
    assert len(pipelined) == len(single) == 16
    # same seed, data and optimizer: equal up to float rounding, which grows a little with the steps
    assert single[:4] == pytest.approx(pipelined[:4], abs=1e-4)
    assert single == pytest.approx(pipelined, abs=2e-2)


def test_digits_cnn_from_tagged_model_on_2_ranks(tmp_path: Path) -> None:
    import digits_cnn

    out = tmp_path / "digits"
    stagewise_run(2, "digits_cnn.py", "--steps=40", "--no-progress", f"--out={out}", cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    assert summary["test_accuracy"] > 0.6  # 10 classes: chance is 0.1
    assert (out / "loss_curve.png").exists()
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    digits_cnn.DigitsNet().load_state_dict(state)  # strict: both stages' parameters, under the model's names


def test_gpt_pipeline_writes_its_metrics(gpt_run: tuple[Path, str]) -> None:
    """``metrics=OUT/metrics``: each rank's series; the loss every rank wrote is what train_step returned (the
    example's CSV, written by the rank holding the last stage), and TensorBoard reads the event files."""
    out = gpt_run[0]
    csv_losses = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader((out / "metrics.csv").open()) if r["loss"]]
    for rank in range(4):
        records = read_metrics(out / "metrics", rank)
        assert series(records, "loss") == csv_losses, rank
        assert len(series(records, "val_loss")) == (3 if rank == 3 else 0)  # steps 0, 8, 16 (the reporting rank)
    first = read_metrics(out / "metrics", 0)
    assert all(r["throughput/tokens_per_s"] > 0 for r in first if "loss" in r)  # rank 0 holds the input tokens
    if tensorboard_installed():
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "metrics" / "rank3"))
        acc.Reload()
        assert {"loss", "lr", "val_loss", "bubble", "time/compute"} <= set(acc.Tags()["scalars"])
        assert [e.value for e in acc.Scalars("loss")] == pytest.approx([v for _, v in csv_losses], rel=1e-6)


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    args = gpt_stdlib.parse_args(["--steps=100", "--warmup=10", "--lr=1.0"])
    assert gpt_stdlib.lr_at(0, args) == pytest.approx(0.1)
    assert gpt_stdlib.lr_at(10, args) == pytest.approx(1.0)
    assert gpt_stdlib.lr_at(100, args) == pytest.approx(0.1)


def test_measured_costs_recover_the_costs_of_a_simulated_step() -> None:
    """The costs read off a timeline are those that made it: the simulated picture is comparable."""
    schedule = sw.build_schedule("1f1b", 4, 8)
    truth = sw.CostModel.uniform(4, forward=1.0, backward_input=1.5, backward_weight=0.5, comm_time=0.25)
    timeline = sw.simulate(schedule, truth).timeline
    costs = reporting.measured_costs([timeline], 4)
    assert costs.forward == pytest.approx((1.0,) * 4)
    assert [costs.backward(s) for s in range(4)] == pytest.approx([2.0] * 4)
    assert costs.latency == pytest.approx(0.25)
    assert sw.simulate(schedule, costs).makespan == pytest.approx(timeline.makespan)


def test_resnet_digits_with_deferred_batchnorm_on_2_ranks(tmp_path: Path) -> None:
    """MindSpore-style tags, BatchNorm2d everywhere: trains, and the running statistics are per step."""
    import resnet_digits

    out = tmp_path / "resnet"
    log = stagewise_run(2, "resnet_digits.py", "--steps=30", "--compare", f"--out={out}", cwd=tmp_path)
    assert "holds BatchNorm layers" not in log  # batchnorm= was chosen: no detection message
    summary = json.loads((out / "summary.json").read_text())
    for run in ("pipelined", "single"):
        assert summary[run]["final_loss"] < summary[run]["first_loss"] - 0.5, (run, summary[run])
        assert summary[run]["test_accuracy"] > 0.5, (run, summary[run])  # 10 classes: chance is 0.1
    # the running statistics lag the weights after 30 steps (55.9 % pipelined); estimated again, 93.6 %
    assert summary["pipelined"]["test_accuracy_update_bn"] > 0.85, summary
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    model = resnet_digits.ResNet()
    model.load_state_dict(state)  # strict: both stages' parameters and buffers, under the model's names
    assert summary["pipelined"]["batches_tracked"] == 30, summary  # once per step, not per micro-batch
    counts = {k: int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}
    assert len(counts) == 15 and set(counts.values()) == {1500 // 64}, counts  # then update_bn's batches
    _run(
        [sys.executable, str(EXAMPLES / "resnet_digits.py"), "--single", "--steps=3", f"--out={tmp_path}/one"], tmp_path
    )
    assert "single" in json.loads((tmp_path / "one" / "summary.json").read_text())


TINY_LLAMA = (
    "--steps=12",
    "--layers=4",
    "--hidden=32",
    "--heads=2",
    "--kv-heads=1",
    "--seq-len=32",
    "--batch-size=8",
    "--microbatches=4",
    "--lr=1e-2",
    "--eval-every=6",
    "--eval-batches=2",
    "--timeline-every=4",
    "--generate=8",
    "--no-progress",
)


@pytest.mark.skipif(
    not os.environ.get("STAGEWISE_HF_GRID"),
    reason="a 4-rank job of ~20 s: `make hf-grid` (from_hf's 4-rank checks run in `make test`)",
)
def test_hf_llama_on_4_ranks_trains_saves_and_reloads(tmp_path: Path) -> None:
    """A transformers Llama through from_hf: the loss falls, the gathered model reloads with from_pretrained and
    gives the pipeline's validation loss, and generates."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    log = stagewise_run(4, "hf_causal_lm.py", *TINY_LLAMA, f"--out={out}", cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] < summary["first_val_loss"] - 0.5  # from about ln 256 = 5.55
    # the pipeline's validation loss (float32, over its micro-batches) vs transformers' on the reloaded model
    assert summary["reloaded_val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-4)
    assert len(summary["generated"].encode("utf-8", errors="replace")) >= 1
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    for name in ("loss_curve.png", "timeline_measured.png", "timeline_simulated.png", "timeline_compare.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "stagewise: a transformers Llama" in log and "generated by the reloaded model" in log


@pytest.mark.skipif(
    not os.environ.get("STAGEWISE_RELAYOUT_ALL"),
    reason="a 4-rank job of ~15 s: `make relayout` (the re-layout's cases run in `make test`)",
)
def test_relayout_shrinks_to_2_processes_and_grows_back_to_4(tmp_path: Path) -> None:
    log = stagewise_run(4, "relayout.py", "--steps=2", "--timeline=around.png", cwd=tmp_path)
    assert "now on (0, 1):" in log and "now on (0, 1, 2, 3) (gpipe)" in log, log[-3000:]
    assert "step 5: loss" in log, log[-3000:]  # the steps after both re-layouts ran
    assert (tmp_path / "around.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the steps and the calls drawn
    parts = json.loads((tmp_path / "around.json").read_text())  # every process's parts of both calls
    assert [len(parts[call]) for call in ("shrink", "grow")] == [4, 4] and "commit" in parts["grow"][3], parts
