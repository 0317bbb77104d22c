"""What a user of ``stagewise run --nnodes MIN:MAX`` meets, on "machines" that are processes of one host.

Each machine is one ``stagewise run -n 1`` (or ``-n 2``) on localhost with a snapshot folder of its own
(tests/system/scripts/elastic_local.py; no root, unlike test_elastic.py's network namespaces):

* a job that restarts once and ends cleanly leaves no snapshot, only the marker of its end; the snapshots a
  machine kept from before the end (as a machine lost for a while would) are refused by the same command run
  again - with the reason - which starts afresh instead of "resuming" a finished job;
* a refusal every rank raises before its first step ends the job at the first attempt, not after every
  restart;
* a lost machine: each surviving machine prints one line (which machine, which ranks, the step, what happens
  next, how long it should take) instead of pages of tracebacks, which go to the file the line names; each
  machine prints the resume line; the user's own prints are untouched.

``make elastic`` (``STAGEWISE_ELASTIC=1``): each job takes 10-40 s on a loaded machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import elastic_local

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not os.environ.get("STAGEWISE_ELASTIC"), reason="elastic jobs on localhost: `make elastic`"),
]


@dataclass
class Local:
    """Machines of one job on localhost: ``stagewise run`` each, in a session of its own."""

    out: Path
    port: int
    nnodes: str
    script: list[str]
    nproc: int = 1
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, *which: int) -> None:
        for i in which:
            cmd = [sys.executable, "-m", "stagewise.cli.main", "run", "-n", str(self.nproc), "--nnodes", self.nnodes]
            cmd += ["--max-restarts", "3", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", f"t{self.port}"]
            cmd += ["--local-addr", "127.0.0.1", "--rdzv-conf", "join_timeout=60", *(["--rdzv-host"] if i == 0 else [])]
            cmd += [elastic_local.__file__, "--out", str(self.out), *self.script]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            env["STAGEWISE_SNAPSHOT_DIR"] = str(self.shm(i))
            log = open(self.log(i), "ab")  # noqa: SIM115 (closed with the process)
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def shm(self, i: int) -> Path:
        return self.out / f"shm{i}"

    def log(self, i: int) -> Path:
        return self.out / f"machine{i}.log"

    def text(self, i: int) -> str:
        return self.log(i).read_text(errors="replace") if self.log(i).exists() else ""

    def lose(self, i: int) -> None:
        """SIGKILL machine ``i``: its launcher and every process under it (torch's workers have sessions of
        their own, so a process group would miss them)."""
        for pid in _tree(self.procs[i].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, i: int, timeout: float = 300) -> int:
        try:
            return self.procs[i].wait(timeout)
        except subprocess.TimeoutExpired:
            self.lose(i)
            pytest.fail(f"machine {i} still running after {timeout} s:\n{self.text(i)[-4000:]}")

    def stop(self) -> None:
        for i, proc in self.procs.items():
            if proc.poll() is None:
                self.lose(i)

    def losses(self) -> list[dict[str, float]]:
        path = self.out / "losses.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _tree(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for c in children for p in _tree(int(c))]


@pytest.fixture
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Local]:
    nnodes, nproc, script = request.param
    made = Local(tmp_path, 29700 + os.getpid() % 200, nnodes, script, nproc)
    yield made
    made.stop()


@pytest.mark.parametrize("job", [("1:1", 2, ["--fail", "5", "--keep-copy", "KEPT"])], indirect=True)
def test_a_finished_jobs_snapshots_are_removed_and_never_resumed(job: Local) -> None:
    kept = job.out / "kept"
    job.script = [str(kept) if a == "KEPT" else a for a in job.script]
    job.start(0)
    assert job.wait(0) == 0, job.text(0)[-4000:]
    assert sorted(p.name for p in (job.out / "attempts").iterdir()) == ["0-r0", "0-r1", "1-r0", "1-r1"]
    assert "resumed step 4 on 2 processes: pp 1 x dp 2, from peer snapshots" in job.text(0)
    folder = job.shm(0) / f"stagewise-t{job.port}"
    left = sorted(p.name for p in folder.iterdir())
    assert len(left) == 1 and re.fullmatch(r"ended-[0-9a-f]+\.json", left[0]), left  # no snapshot, one marker
    assert json.loads((folder / left[0]).read_text())["step"] == 8
    # a machine that was away at the end would still hold these: the same command again starts afresh
    for path in kept.iterdir():
        shutil.copy(path, folder / path.name)
    (job.out / "losses.jsonl").unlink()
    job.script = []  # the same job again, without the failure
    job.start(0)
    assert job.wait(0) == 0, job.text(0)[-4000:]
    assert [r["step"] for r in job.losses()] == list(range(1, 9))  # trained from the start
    text = job.text(0)
    refused = r"refused the snapshots of step [\d/]*4 on machine 0: their job \([0-9a-f]+\) ended cleanly at step 8"
    assert re.search(refused, text), text
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".snap") == []


@pytest.mark.parametrize("job", [("1:1", 2, ["--refuse"])], indirect=True)
def test_a_refusal_of_every_rank_before_its_first_step_ends_the_job_at_once(job: Local) -> None:
    job.start(0)
    assert job.wait(0) == 1
    assert sorted(p.name for p in (job.out / "attempts").iterdir()) == ["0-r0", "0-r1"]  # no restart
    text = job.text(0)
    assert "ValueError: this script refuses to run" in text.splitlines()[-1]
    assert "every process failed before its first step: not restarted" in text


@pytest.mark.parametrize("job", [("2:3", 1, ["--hold", "5"])], indirect=True)
def test_a_lost_machine_is_one_line_on_each_survivor(job: Local) -> None:
    job.start(0, 1, 2)
    deadline = time.monotonic() + 300
    while len(list(job.out.glob("hold-r*"))) < 3:
        assert time.monotonic() < deadline, job.text(0)[-3000:]
        time.sleep(0.2)
    job.lose(2)
    (job.out / "go").touch()
    assert [job.wait(0), job.wait(1)] == [0, 0], job.text(0)[-4000:] + job.text(1)[-4000:]
    for i in (0, 1):
        text = job.text(i)
        lost = [line for line in text.splitlines() if "lost machine" in line]
        assert len(lost) == 1, text
        assert re.search(r"lost machine (\d) \(rank \1\) after step 5", lost[0]), lost  # (-n 1: machine i, rank i)
        assert "resuming from the newest snapshot" in lost[0] and "noticed in 3 s" in lost[0]
        assert "tracebacks: " in lost[0]
        traces = Path(lost[0].rsplit("tracebacks: ", 1)[1].split()[0])
        assert "Traceback (most recent call last)" in "".join(p.read_text() for p in traces.glob("*.txt"))
        assert "Traceback" not in text and "TCPStore" not in text, text
        assert "resumed step 4 on 2 processes (was 3): pp 1 x dp 2 (was pp 1 x dp 3), from peer snapshots" in text
        assert f"user print: rank {i} finished at step 8 on 2 processes" in text


@pytest.mark.parametrize("job", [("2:3", 1, ["--hold", "5"])], indirect=True)
def test_the_rendezvous_hosts_machine_lost_is_one_line_on_each_survivor(job: Local) -> None:
    """Machine 0 hosts the rendezvous store (``--rdzv-host``): losing it ends the job, which each survivor says
    in one line, not with torch's C++ warning and keep-alive line of every call that finds the store gone."""
    job.start(0, 1, 2)
    deadline = time.monotonic() + 300
    while len(list(job.out.glob("hold-r*"))) < 3:
        assert time.monotonic() < deadline, job.text(0)[-3000:]
        time.sleep(0.2)
    job.lose(0)
    (job.out / "go").touch()
    assert [job.wait(1), job.wait(2)] == [1, 1], job.text(1)[-4000:] + job.text(2)[-4000:]
    for i in (1, 2):
        text = job.text(i)
        gone = [line for line in text.splitlines() if "is unreachable" in line]
        assert len(gone) == 1 and f"the rendezvous store at 127.0.0.1:{job.port} is unreachable" in gone[0], text
        assert "TCPStore" not in text and "Traceback" not in text and "keep-alive" not in text, text
