"""Leaving after a failure by ``sys.exit(1)``: exit code 1 on every rank, never an abort, the failing rank blamed.

Rank 1 of a 2-rank job raises inside ``train_step``; both ranks catch what they get and call ``sys.exit(1)``
(tests/system/scripts/exit_paths.py). That used to abort rank 0 now and then: a helper thread of its pipeline,
left in a gloo wait on rank 1, returned from it while the interpreter finalized ("terminate called without an
active exception", SIGABRT), and torchrun's summary then named rank 0 as the root cause. Intermittent, so the
plain-process job runs a few times (two at once); one run goes through ``stagewise run``, whose summary must name
rank 1 and whose last line must be the first cause. One more job has rank 1 raise between two steps, in the
script's own code: it used to die still registering shared-memory names its peer had removed, and Python's
resource tracker then warned of "leaked" objects and "No such file or directory".
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import exit_paths

RUNS = 3
ABORTS = ("terminate called", "Fatal Python error", "core dumped", "SIGABRT")
TRACKER = ("resource_tracker", "leaked shared_memory", "No such file or directory")
GUARD_S = 240.0  # start-up on a loaded machine plus the job's timeouts: a hang guard, not a bound

pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(out: Path, how: str = "sys-exit", transport: str = "auto") -> tuple[dict[int, int | None], str]:
    """Both ranks as plain processes with torchrun's variables (rank 0 hosts the store): exit codes, logs."""
    out.mkdir(parents=True)
    port, procs = _free_port(), {}
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(k, None)
        cmd = [sys.executable, exit_paths.__file__, "--exit", how, "--out", str(out), "--transport", transport]
        procs[r] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    codes: dict[int, int | None] = {}
    logs = []
    for r, p in procs.items():
        try:
            text, _ = p.communicate(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            text, _ = p.communicate()
        codes[r] = p.returncode if p.returncode != -signal.SIGKILL else None
        logs.append(f"--- rank {r} (exit {codes[r]}) ---\n{text}")
    return codes, "\n".join(logs)


def _report(out: Path, rank: int) -> str:
    path = out / f"rank{rank}.txt"
    return path.read_text() if path.exists() else f"(rank {rank} wrote no report)"


def test_sys_exit_after_a_failure_exits_1_on_every_rank_and_never_aborts(tmp_path: Path) -> None:
    how = ["sys-exit"] * RUNS + ["outside"]
    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(lambda k: _job(tmp_path / f"run{k}", how[k]), range(len(how))))
    codes, log = jobs.pop()  # outside: rank 1's uncaught error, rank 0's PipelineError caught, sys.exit(1)
    assert codes == {0: 1, 1: 1}, f"exit codes {codes} (None: hung), expected 1 on both\n{log[-4000:]}"
    assert not any(sign in log for sign in (*ABORTS, *TRACKER)), log[-4000:]
    assert _report(tmp_path / f"run{RUNS}", 0).startswith("PipelineError: rank 1: ValueError"), log[-4000:]
    for k, (codes, log) in enumerate(jobs):
        assert codes == {0: 1, 1: 1}, f"run {k}: exit codes {codes} (None: hung), expected 1 on both\n{log[-4000:]}"
        assert not any(sign in log for sign in ABORTS), f"run {k} aborted\n{log[-4000:]}"
        rank0, rank1 = _report(tmp_path / f"run{k}", 0), _report(tmp_path / f"run{k}", 1)
        assert rank0.startswith("PipelineError: rank 1"), (rank0, log[-4000:])  # the failing rank first
        assert rank1.startswith("ValueError: the layer on rank 1"), (rank1, log[-4000:])


def test_stagewise_run_blames_the_rank_that_failed_and_ends_with_the_cause(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stagewise.cli", "run", "-n", "2", exit_paths.__file__]
    cmd += ["--exit", "sys-exit", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=GUARD_S, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]
    assert not any(sign in log for sign in ABORTS), log[-3000:]
    root = re.search(r"Root Cause \(first observed failure\):(.*?)(?:={10,}|$)", log, re.S)
    assert root is not None, log[-3000:]
    assert re.search(r"rank\s*:\s*1 ", root.group(1)) and re.search(r"exitcode\s*:\s*1 ", root.group(1)), log[-3000:]
    last = log.strip().splitlines()[-1]  # the first cause, where the eye lands: rank, action, message
    assert last == "stagewise run: rank 1 at 1F0: ValueError: the layer on rank 1 raised", log[-3000:]
    assert not any(sign in log for sign in TRACKER), log[-3000:]


# A collective called on some ranks only: a rank left waiting names the call its peer is in (or that its script
# ended) within seconds, where it used to wait out the timeout (20 s here, 300 by default) and blame no one. Both
# ranks wait in vain in the first two ways, and either may be the first to see it: either's words stand.
def _both(a: tuple[int, str], b: tuple[int, str]) -> list[str]:
    return [
        f"global rank {x} is in {cx} while global rank {y} waits in {cy} (the 3rd"
        for (x, cx), (y, cy) in ((a, b), (b, a))
    ]


ENDED = [  # (every way names the processes by their global ranks, as the peers are named)
    "global rank 1's script ended after 2 collective calls, the last a train_step, while global rank 0 waits in its "
    "3rd collective call, a train_step"
]
MISMATCHES = {  # (way, transport) -> what every failing rank's message starts with: one of these
    ("save-on-0", "shm"): _both((0, "sw.checkpoint.save"), (1, "train_step")),
    ("eval-on-1", "torch"): _both((1, "eval_loss"), (0, "train_step")),
    ("one-more-on-0", "torch"): ENDED,  # gloo's closed connection
    ("one-more-on-0", "shm"): ENDED,  # the peer's process gone
    ("relayout-on-0", "torch"): [  # (the re-layout's waits name their process by its global rank)
        "global rank 1 is in train_step while global rank 0 waits in pipe.relayout (the 3rd",
        "global rank 0 is in pipe.relayout while global rank 1 waits in train_step (the 3rd",
    ],
}


def test_a_collective_on_some_ranks_only_is_named_before_the_timeout(tmp_path: Path) -> None:
    ways = list(MISMATCHES)
    with ThreadPoolExecutor(len(ways)) as pool:
        jobs = list(pool.map(lambda w: _job(tmp_path / "-".join(w), *w), ways))
    for (way, transport), (codes, log) in zip(ways, jobs, strict=True):
        words, out = MISMATCHES[way, transport], tmp_path / f"{way}-{transport}"
        ended = way == "one-more-on-0"  # rank 1's script ends cleanly: exit 0
        expected = {0: 1, 1: 0 if ended else 1}
        assert codes == expected, (
            f"{way} on {transport}: exit codes {codes} (None: hung), expected {expected}\n{log[-4000:]}"
        )
        for rank in (0,) if ended else (0, 1):
            said = _report(out, rank)
            assert any(said.startswith(f"PipelineError: {w}") for w in words), (way, rank, said, log[-4000:])
            assert "are collectives: make each call on every rank" in said and "waited 20" not in said, (way, said)
            assert "GLHF" not in said and "died" not in said, (way, said)  # an ended script is no crash
        if ended:
            assert _report(out, 1) == "ok"
