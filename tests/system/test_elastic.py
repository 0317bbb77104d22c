"""Three machines of two processes lose one at step 11 and take it back at step 20: ``stagewise run --nnodes 2:3``.

Three network namespaces on one bridge (tests/helpers/netns.py: each with its own memory file system)
run tests/system/scripts/elastic_train.py under ``stagewise run -n 2 --nnodes 2:3 --max-restarts 3``:
a float64 LM at ``sw.ElasticLayout(pp=2, batch=24, microbatch_size=2)`` - pp 2 x dp 3 on six processes,
pp 2 x dp 2 on four - with snapshots every 2 steps (``snapshot=2``) and checkpoints on disk every 8.

1. Six processes train to step 11, each rank's snapshot of step 10 copied; every process of machine 2 is
   SIGKILLed. The survivors' workers fail, their agents meet again without it, and four processes resume
   from the peers' snapshots of step 10 (machine 2's state is on machine 0), recomputing step 11 only.
2. At step 20 machine 2 is started again, with empty memory: the agents take it in, and six processes
   resume from the snapshots of step 20 (its ranks' state sent over from the others) and finish at 24.

Checked: every step trained, the sizes and sources of the resumes and their one log line; the states
resumed equal, to the bit, the states the job had at steps 10 and 20; the losses after the shrink equal
those of a fresh job of four processes started from the resumed state (float64, to the bit), and every
loss equals the one-process model's to rounding. Needs root (``ip netns``), skipped otherwise; a few
minutes on two cores. The faults during recovery are in test_elastic_faults.py (``make elastic``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_train as et
import stagewise as sw
from helpers import models as mdl
from helpers import netns

pytestmark = pytest.mark.timeout(900)

STEPS, EVERY = 24, 2
PORT = 29530
RDZV_CONF = "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def run_args(machines: netns.Machines, i: int, out: Path, extra: list[str]) -> list[str]:
    """``stagewise run`` on machine ``i`` of an elastic job of 2 to 3 machines (machine 0 hosts the store)."""
    args = ["-n", "2", "--nnodes", "2:3", "--max-restarts", "3", "--rdzv-endpoint", f"{machines.addr(0)}:{PORT}"]
    args += ["--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF, "--local-addr", machines.addr(i)]
    args += ["--rdzv-host"] if i == 0 else []
    return [*args, et.__file__, "--out", str(out), *extra]


def markers(out: Path, prefix: str) -> int:
    return len(list(out.glob(f"{prefix}-r*")))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out = tmp_path_factory.mktemp("elastic")
    extra = ["--steps", str(STEPS), "--every", str(EVERY), "--save-every", "8", "--holds", "11@6,20@4"]
    extra += ["--trace", "10,20", "--start-world", "6"]
    logs = [out / f"machine{i}.log" for i in range(3)]

    def tails() -> str:
        return "\n".join(f"--- machine {i} ---\n{p.read_text(errors='replace')[-5000:]}" for i, p in enumerate(logs))

    with netns.make(f"se{os.getpid() % 1000}", 3, subnet=os.getpid() % 200 + 20) as machines:
        for i in range(3):
            machines.start(i, run_args(machines, i, out, extra), logs[i])
        netns.wait_for("six processes at step 11", lambda: markers(out, "hold-11-w6") == 6, 400, tails)
        killed = machines.kill(2)
        (out / "go-11-w6").touch()
        netns.wait_for("four processes at step 20", lambda: markers(out, "hold-20-w4") == 4, 400, tails)
        restarted = time.time()
        machines.start(2, run_args(machines, 2, out, extra), logs[2])
        codes = [machines.wait(i, 400) for i in range(3)]
        if codes != [0, 0, 0]:
            pytest.fail(f"the machines exited {codes}\n{tails()}")
        yield {"out": out, "killed": killed, "restarted": restarted, "logs": "\n".join(p.read_text() for p in logs)}


def rows(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_survivors_continue_and_the_machine_is_taken_back(job: dict[str, Any]) -> None:
    trained = rows(job["out"], "losses.jsonl")
    worlds = [(r["step"], r["world"]) for r in trained]
    assert worlds == [(s, 6) for s in range(1, 12)] + [(s, 4) for s in range(11, 21)] + [(s, 6) for s in range(21, 25)]
    resumes = rows(job["out"], "resumes.jsonl")
    assert resumes == [{"step": 10, "world": 4, "source": "snapshots"}, {"step": 20, "world": 6, "source": "snapshots"}]
    lost = 11 - resumes[0]["step"]
    assert 0 < lost <= EVERY  # at most k steps recomputed (step 11, trained before the loss)


def test_one_line_says_what_happened(job: dict[str, Any]) -> None:
    for line in [
        "resumed step 10 on 4 processes (was 6): pp 2 x dp 2 (was pp 2 x dp 3), from peer snapshots",
        "resumed step 20 on 6 processes (was 4): pp 2 x dp 3 (was pp 2 x dp 2), from peer snapshots",
    ]:
        assert line in job["logs"], line


def state(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's parameters and AdamW state by name, through the one-process model."""
    model = sw.build_model(et.layers())
    opt = et.adamw(list(model.parameters()))
    sw.checkpoint.load(folder, model, opt, collective=False)
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entries in opt.state.items():
        out.update({f"{names[id(p)]}/{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    return out


@pytest.mark.parametrize(("resumed", "trained"), [("w4-s10", "step-00000010"), ("w6-s20", "step-00000020")])
def test_resumed_state_is_the_trained_one(job: dict[str, Any], resumed: str, trained: str) -> None:
    """The state resumed from the snapshots (at the new size) equals, to the bit, the state the job had."""
    got, want = state(job["out"] / "resumed" / resumed), state(job["out"] / "trace" / trained)
    assert sorted(got) == sorted(want) and any("/exp_avg" in k for k in want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_losses_after_the_shrink_are_a_fresh_jobs(job: dict[str, Any]) -> None:
    """A fresh job of four processes from the state resumed at step 10: the same losses, to the bit."""
    out = job["out"]
    cmd = [sys.executable, "-m", "stagewise.cli.main", "run", "-n", "4", et.__file__, "--out", str(out)]
    cmd += ["--reference", str(out / "resumed" / "w4-s10"), "--steps", "20"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = {r["step"]: r["loss"] for r in rows(out, "reference-w4-s10.jsonl")}
    shrunk = {r["step"]: r["loss"] for r in rows(out, "losses.jsonl") if r["world"] == 4}
    assert sorted(reference) == list(range(11, 21)) and shrunk == reference


def test_every_loss_is_the_one_process_models(job: dict[str, Any]) -> None:
    """Each step's loss, whatever the size that trained it, equals the one-process model's in float64."""
    model = sw.build_model(et.layers(), seed=et.SEED)
    opt = et.adamw(list(model.parameters()))
    want = []
    for step in range(1, STEPS + 1):
        x, y = mdl.lm_data(et.LAYOUT.batch, seed=100 + step)
        loss = mdl.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    last = {r["step"]: r["loss"] for r in rows(job["out"], "losses.jsonl")}
    torch.testing.assert_close(torch.tensor([last[s] for s in range(1, STEPS + 1)]), torch.tensor(want), rtol=1e-10, atol=0)
