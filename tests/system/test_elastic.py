"""Three machines of two processes lose one at step 11 and take it back at step 20: ``stagewise run --nnodes 2:3``.

Three network namespaces on one bridge (tests/helpers/netns.py: each with its own memory file system)
run tests/system/scripts/elastic_train.py under ``stagewise run -n 2 --nnodes 2:3 --max-restarts 3``
(tests/system/scripts/elastic_harness.py): a float64 LM at ``sw.ElasticLayout(pp=2, batch=24,
microbatch_size=2)`` - pp 2 x dp 3 on six processes, pp 2 x dp 2 on four - with snapshots every 2 steps
(``snapshot=2``) and checkpoints on disk every 8.

1. Six processes train to step 11, each rank's snapshot of step 10 copied; every process of machine 2 is
   SIGKILLed. The survivors' workers fail, their agents meet again without it, and four processes resume
   from the peers' snapshots of step 10 (machine 2's state is on machine 0), recomputing step 11 only.
2. At step 20 machine 2 is started again, with empty memory: the agents take it in, and six processes
   resume from the snapshots of step 20 (its ranks' state sent over from the others) and finish at 24.

Checked: every step trained, the sizes and sources of the resumes and their one log line; the states
resumed equal, to the bit, the states the job had at steps 10 and 20; the losses after the shrink equal
those of a fresh job of four processes started from the resumed state (float64, to the bit), and every
loss equals the one-process model's to rounding. Needs root (``ip netns``), skipped otherwise; a few
minutes on two cores: ``make elastic`` runs it (``STAGEWISE_ELASTIC=1``; ``make test`` skips it, to stay near its
time), with the faults during recovery of test_elastic_faults.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import elastic_train as et
import stagewise as sw
from elastic_harness import Job, no_abort, same_state
from helpers import models as mdl
from helpers import netns

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not os.environ.get("STAGEWISE_ELASTIC"), reason="machines lost and taken back: `make elastic`"),
]

STEPS, EVERY = 24, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    out = tmp_path_factory.mktemp("elastic")
    script = ["--steps", str(STEPS), "--every", str(EVERY), "--save-every", "8", "--holds", "11@6,20@4"]
    script += ["--trace", "10,20", "--start-world", "6"]
    with netns.make(f"se{os.getpid() % 1000}", 3, subnet=os.getpid() % 100 + 20) as machines:
        job = Job(machines, out, script, port=29530)
        job.start(0, 1, 2)
        job.wait_markers("hold-11-w6", 6)
        job.lose(2)
        job.release("go-11-w6")
        job.wait_markers("hold-20-w4", 4)
        job.start(2)  # with empty memory; the held processes are restarted by their agents
        codes = job.exits([0, 1, 2])
        if codes != [0, 0, 0]:
            pytest.fail(f"the machines exited {codes}\n{job.tails()}")
        yield job


def test_survivors_continue_and_the_machine_is_taken_back(job: Job) -> None:
    worlds = [(r["step"], r["world"]) for r in job.rows("losses.jsonl")]
    assert worlds == [(s, 6) for s in range(1, 12)] + [(s, 4) for s in range(11, 21)] + [(s, 6) for s in range(21, 25)]
    resumes = job.rows("resumes.jsonl")
    assert resumes == [{"step": 10, "world": 4, "source": "snapshots"}, {"step": 20, "world": 6, "source": "snapshots"}]
    lost = 11 - resumes[0]["step"]
    assert 0 < lost <= EVERY  # at most k steps recomputed (step 11, trained before the loss)
    no_abort(job)


def test_one_line_says_what_happened(job: Job) -> None:
    logs = job.logs()
    for line in [
        "resumed step 10 on 4 processes (was 6): pp 2 x dp 2 (was pp 2 x dp 3), from peer snapshots",
        "resumed step 20 on 6 processes (was 4): pp 2 x dp 3 (was pp 2 x dp 2), from peer snapshots",
    ]:
        assert line in logs, line


@pytest.mark.parametrize(("resumed", "trained"), [("w4-s10", "step-10"), ("w6-s20", "step-20")])
def test_resumed_state_is_the_trained_one(job: Job, resumed: str, trained: str) -> None:
    """The state resumed from the snapshots (at the new size) equals, to the bit, the state the job had."""
    same_state(job.out / "resumed" / resumed, job.out / "trace" / trained)


def test_losses_after_the_shrink_are_a_fresh_jobs(job: Job) -> None:
    """A fresh job of four processes from the state resumed at step 10: the same losses, to the bit."""
    out = job.out
    cmd = [sys.executable, "-m", "stagewise.cli.main", "run", "-n", "4", et.__file__, "--out", str(out)]
    cmd += ["--reference", str(out / "resumed" / "w4-s10"), "--steps", "20"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference = {r["step"]: r["loss"] for r in job.rows("reference-w4-s10.jsonl")}
    shrunk = {r["step"]: r["loss"] for r in job.rows("losses.jsonl") if r["world"] == 4}
    assert sorted(reference) == list(range(11, 21)) and shrunk == reference


def test_every_loss_is_the_one_process_models(job: Job) -> None:
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
    last = {r["step"]: r["loss"] for r in job.rows("losses.jsonl")}
    got = torch.tensor([last[s] for s in range(1, STEPS + 1)])
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-10, atol=0)
