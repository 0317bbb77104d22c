"""``stagewise run --max-restarts``: a job whose ranks are SIGKILLed on its first attempts finishes as if never
interrupted.

Two jobs of tests/system/scripts/restart_train.py run side by side (2 ranks, pp=2
1f1b, float64, dropout, AdamW, a checkpoint every 2 steps of 12): one
uninterrupted, one killed on each of its first attempts - either rank,
before a step, in the middle of one, or after writing its share of a
checkpoint whose manifest never comes. ``make test`` kills three attempts (one
of each kind, both ranks); ``make faults`` (STAGEWISE_FAULTS=1) six, among them
the last checkpoint left incomplete. Every
attempt resumes from the newest complete checkpoint with
``sw.checkpoint.resume`` and replays the data from there. The killed job must
use every attempt and end with the same losses and the same parameters
and optimizer state, to the last bit. Also the command line of
``stagewise run``'s new options (no processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import restart_train
import stagewise as sw
from stagewise.cli.main import main

#: up to seven torchrun attempts of two processes each: on a loaded machine a start alone takes seconds
pytestmark = pytest.mark.timeout(900)

STEPS = 12
#: attempt -> (rank, step, when): each kill lands after the checkpoint the attempt resumed from (`make faults`)
ALL_KILLS = [
    (1, 3, "mid"),  # resumes from step 2
    (0, 4, "before"),
    (1, 4, "save"),  # a .step-4.tmp left behind; the next attempt resumes from step 2 again
    (0, 5, "mid"),  # step 4's checkpoint was completed this time: the next attempt resumes from it
    (1, 7, "before"),
    (0, 12, "save"),  # the last checkpoint never completes: the last attempt redoes steps 11-12
]
#: `make test`: each kind of kill once, on both ranks (four attempts, not seven: each start costs seconds)
SOME_KILLS = [
    (1, 3, "mid"),  # resumes from step 2
    (0, 4, "save"),  # a .step-4.tmp left behind; the next attempt resumes from step 2 again
    (1, 5, "before"),  # step 4's checkpoint was completed this time: the next attempt resumes from it
]
KILLS = ALL_KILLS if os.environ.get("STAGEWISE_FAULTS") else SOME_KILLS


def _job(out: Path, kills: str, restarts: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "stagewise.cli.main", "run", "-n", "2", "--max-restarts", str(restarts)]
    cmd += [restart_train.__file__, "--out", str(out), "--steps", str(STEPS), "--save-every", "2"]
    cmd += ["--kills", kills]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOGLEVEL="WARNING")
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("restarts")
    kills = ",".join(f"{a}:{r}:{s}:{w}" for a, (r, s, w) in enumerate(KILLS))
    jobs = {"plain": _job(root / "plain", "", 0), "killed": _job(root / "killed", kills, len(KILLS))}
    for name, job in jobs.items():
        try:
            code = job.wait(timeout=800)
        except subprocess.TimeoutExpired:
            job.kill()
            code = job.wait()
        log = (root / name).with_suffix(".log").read_text()
        assert code == 0, f"job {name!r} exited {code}; log tail:\n{log[-6000:]}"
    return {name: root / name for name in jobs}


def _final(folder: Path) -> tuple[sw.checkpoint.CheckpointInfo, dict[str, torch.Tensor]]:
    model = sw.build_model(restart_train.layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    info = sw.checkpoint.load(folder / "ckpt", model, opt, collective=False)
    tensors = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                tensors[f"optim/{names[id(p)]}/{key}"] = torch.as_tensor(value)
    return info, tensors


def test_every_attempt_ran_and_was_killed(runs: dict[str, Path]) -> None:
    started = sorted(p.name for p in (runs["killed"] / "attempts").iterdir())
    assert started == sorted(f"{a}-{r}" for a in range(len(KILLS) + 1) for r in (0, 1))
    assert sorted(p.name for p in (runs["plain"] / "attempts").iterdir()) == ["0-0", "0-1"]


def test_killed_job_ends_bit_exact(runs: dict[str, Path]) -> None:
    plain, plain_tensors = _final(runs["plain"])
    killed, killed_tensors = _final(runs["killed"])
    assert plain.step == killed.step == STEPS
    assert len(plain.extra["losses"]) == STEPS
    assert killed.extra["losses"] == plain.extra["losses"]  # every step's loss, to the last bit
    assert sorted(killed_tensors) == sorted(plain_tensors)
    assert any(k.startswith("optim/") for k in plain_tensors)
    different = [k for k in plain_tensors if not torch.equal(plain_tensors[k], killed_tensors[k])]
    assert not different, different


def test_run_passes_restarts_and_rendezvous(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    calls: list[list[str]] = []
    import stagewise.runtime.launch as launch

    monkeypatch.setattr(launch, "torchrun", lambda argv: calls.append(argv) or 0)
    assert main(["run", "-n", "2", "--max-restarts", "3", str(script), "--x"]) == 0
    assert (
        main(["run", "-n", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", str(script)])
        == 0
    )
    assert calls == [
        ["--standalone", "--max-restarts=3", "--nproc-per-node=2", str(script), "--x"],
        [
            "--nnodes=2",
            "--node-rank=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=10.0.0.1:29400",
            "--rdzv-conf=is_host=false",
            "--nproc-per-node=2",
            str(script),
        ],
    ]
