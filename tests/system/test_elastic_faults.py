"""Faults during the recovery of an elastic job: each ends in a resumed job or a clean exit that says why.

``make elastic`` (``STAGEWISE_ELASTIC=1``; skipped in ``make test``: a 3-machine job of a minute or two
each). The job is tests/system/test_elastic.py's (elastic_train.py on three namespace machines of two
processes, snapshots every 2 steps, checkpoints on disk every 8), with one fault each:

* a second machine lost while the survivors meet again (``--nnodes 1:3``): the last one goes on alone;
* a machine lost in the middle of a checkpoint save (its share written, the manifest never): the survivors
  resume from the snapshots, the half-written checkpoint is never read;
* a machine lost in the middle of a snapshot's copy to its peer: the survivors resume from a generation
  whose files are whole, to the bit what the job had at that step;
* the machine hosting the rendezvous store lost: the survivors exit with status 1 and one line saying the
  store is gone and where to host it instead; hosted by ``stagewise rendezvous`` on a fourth machine, the
  same loss is survived;
* fewer than MIN machines left: a clean exit after ``join_timeout``, naming MIN.

In every case: no process hangs (each wait of the harness has a deadline, and fails the test), none aborts
(no SIGABRT, "terminate called" or core dump in any log), and every state resumed equals, to the bit, the
state the job had at the step it says.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_harness import FAST_RDZV, Job, no_abort, same_state
from helpers import netns

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not os.environ.get("STAGEWISE_ELASTIC"), reason="faults during recovery: `make elastic` (STAGEWISE_ELASTIC=1)"
    ),
]

STEPS = 16


@pytest.fixture
def machines(request: pytest.FixtureRequest) -> Iterator[netns.Machines]:
    count = getattr(request, "param", 3)
    with netns.make(f"sf{os.getpid() % 1000}", count, subnet=os.getpid() % 100 + 120) as made:
        yield made


def script(*extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--every", "2", "--save-every", "8", "--start-world", "6", *extra]


def resumed_exactly(job: Job) -> dict[str, object]:
    """The last resume came from the snapshots and its state is the one the job had at that step."""
    last = job.rows("resumes.jsonl")[-1]
    folder = job.out / "resumed" / f"w{last['world']}-s{last['step']}"
    same_state(folder, job.out / "trace" / f"step-{last['step']}")
    return last


def trained_to_the_end(job: Job, world: int) -> None:
    rows = job.rows("losses.jsonl")
    assert rows[-1]["step"] == STEPS and rows[-1]["world"] == world, rows[-3:]
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))


def test_second_machine_lost_while_the_survivors_meet(machines: netns.Machines, tmp_path: Path) -> None:
    slower = FAST_RDZV.replace("last_call_timeout=2", "last_call_timeout=8")  # MIN 1: let the first round wait
    job = Job(machines, tmp_path, script("--holds", "11@6", "--trace", "8,10"), nnodes="1:3", rdzv_conf=slower)
    job.start(0, 1, 2)
    job.wait_markers("hold-11-w6", 6)
    job.lose(2)
    job.release("go-11-w6")
    netns.wait_for("machine 1's workers to fail", lambda: job.workers_gone(1), 120, job.tails)
    job.lose(1)  # its agent is meeting the others again
    assert job.exits([0]) == [0], job.tails()
    last = resumed_exactly(job)
    assert last["world"] == 2 and last["source"] == "snapshots" and last["step"] in (8, 10), last
    trained_to_the_end(job, 2)
    assert "on 2 processes (was " in job.logs()
    no_abort(job)


def test_machine_lost_in_a_checkpoint_save(machines: netns.Machines, tmp_path: Path) -> None:
    job = Job(machines, tmp_path, script("--stall-save", "8@2", "--trace", "6,8"))
    job.start(0, 1, 2)
    job.wait_markers("saving-8", 2)  # machine 2's ranks wrote their share of step 8; no manifest yet
    job.lose(2)
    assert job.exits([0, 1]) == [0, 0], job.tails()
    last = resumed_exactly(job)
    assert last["world"] == 4 and last["source"] == "snapshots" and last["step"] in (6, 8), last
    assert (tmp_path / "ckpt" / "step-00000016").is_dir()
    trained_to_the_end(job, 4)
    no_abort(job)


def test_machine_lost_in_a_snapshot_copy(machines: netns.Machines, tmp_path: Path) -> None:
    job = Job(machines, tmp_path, script("--stall-snapshot", "10@2", "--trace", "8,10"))
    job.start(0, 1, 2)
    job.wait_markers("copying-10", 2)  # machine 2's ranks wrote their snapshot of step 10, not sent it
    job.lose(2)
    assert job.exits([0, 1]) == [0, 0], job.tails()
    last = resumed_exactly(job)
    assert last["world"] == 4 and last["step"] in (8, 10), last
    trained_to_the_end(job, 4)
    no_abort(job)


def test_rendezvous_host_lost(machines: netns.Machines, tmp_path: Path) -> None:
    job = Job(machines, tmp_path, script("--holds", "11@6"))
    job.start(0, 1, 2)
    job.wait_markers("hold-11-w6", 6)
    job.lose(0)  # it hosted the store (--rdzv-host)
    job.release("go-11-w6")
    assert job.exits([1, 2], timeout=300) == [1, 1], job.tails()
    for i in (1, 2):
        text = job.log(i).read_text()
        assert f"the rendezvous store at {machines.addr(0)}:{job.port} is unreachable" in text, job.tails()
        assert "stagewise rendezvous --port" in text
    no_abort(job)


@pytest.mark.parametrize("machines", [4], indirect=True)
def test_store_hosted_apart_survives_losing_machine_0(machines: netns.Machines, tmp_path: Path) -> None:
    job = Job(machines, tmp_path, script("--holds", "11@6", "--trace", "10"))
    job.store = job.host_store(3)  # a fourth machine runs the store, no workers
    job.start(0, 1, 2)
    job.wait_markers("hold-11-w6", 6)
    job.lose(0)  # the agent that was rendezvous rank 0, and the workers' store host
    job.release("go-11-w6")
    assert job.exits([1, 2]) == [0, 0], job.tails()
    last = resumed_exactly(job)
    assert (last["world"], last["step"], last["source"]) == (4, 10, "snapshots"), last
    trained_to_the_end(job, 4)
    no_abort(job)


def test_fewer_than_min_machines_left(machines: netns.Machines, tmp_path: Path) -> None:
    conf = FAST_RDZV.replace("join_timeout=90", "join_timeout=45")  # (the first rendezvous must fit in it too)
    job = Job(machines, tmp_path, script("--holds", "11@6"), rdzv_conf=conf)
    job.start(0, 1, 2)
    job.wait_markers("hold-11-w6", 6)
    job.lose(1, 2)
    job.release("go-11-w6")
    assert job.exits([0], timeout=300) == [1], job.tails()
    text = job.log(0).read_text()
    assert "fewer than 2 machines (--nnodes 2:3) joined the rendezvous store" in text, job.tails()
    assert "join_timeout=45 s" in text
    no_abort(job)
