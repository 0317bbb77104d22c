"""Ctrl-C on ``stagewise run -n 2 script.py``: one line saying where the job stopped, exit status 130, no
traceback, and nothing of the job left in /dev/shm; SIGTERM to the launcher alike (exit status 143).

The job (tests/system/scripts/interrupt_train.py) trains until it is stopped, with a checkpoint every 3 steps.
The test starts the launcher in a process group of its own, as a terminal starts a foreground job, waits until
rank 0 has finished 7 steps, and sends SIGINT to that group, as Ctrl-C does (torch's launcher starts the workers
in sessions of their own: the launcher hands the signal on).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import interrupt_train

SAVE_EVERY = 3
AT_STEP = 7  # Ctrl-C once rank 0 has finished this many steps (two checkpoints saved)

pytestmark = pytest.mark.timeout(400)


def _progress(folder: Path) -> int:
    try:
        return int((folder / "progress").read_text())
    except (OSError, ValueError):
        return 0


def _interrupted_job(folder: Path, sig: signal.Signals) -> tuple[int, str, int]:
    """Run the job, press Ctrl-C (or send ``sig``) at :data:`AT_STEP`: (exit status, everything it printed, rank
    0's steps then)."""
    cmd = [sys.executable, "-m", "stagewise.cli", "run", "-n", "2", interrupt_train.__file__, "--out", str(folder)]
    cmd += ["--save-every", str(SAVE_EVERY)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while _progress(folder) < AT_STEP and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        reached = _progress(folder)
        assert job.poll() is None and reached >= AT_STEP, f"the job did not reach step {AT_STEP}: {job.communicate()}"
        if sig == signal.SIGINT:
            os.killpg(job.pid, sig)  # the terminal's Ctrl-C: the foreground group
        else:
            os.kill(job.pid, sig)  # a scheduler's stop: the launcher's process
        out, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, out, reached


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_prints_one_line_exits_130_and_leaves_no_shared_memory(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (a scheduler's stop: SLURM, Kubernetes) as Ctrl-C, exit status 143: it gave torch's traceback."""
    code, out, reached = _interrupted_job(tmp_path, sig)
    assert code == 128 + int(sig), out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    head = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"
    found = re.fullmatch(rf"{head}: rank ([01]) stopped after step (\d+); last checkpoint (\S+)", lines[0])
    assert found is not None, lines[0]
    steps, named = int(found[2]), tmp_path / found[3]
    # a step ends with every rank holding its loss: the rank furthest behind had finished what rank 0 had
    assert steps >= reached, (steps, reached)
    # the checkpoint named is a complete one, among the newest two the job can have finished by then
    assert named.parent == tmp_path / "ckpt" and (named / "MANIFEST.json").is_file(), named
    saved = int(named.name.removeprefix("step-"))
    assert saved % SAVE_EVERY == 0 and steps - 2 * SAVE_EVERY < saved <= steps, (saved, steps)
    # every name of the job's shared-memory transport is gone with it (the launcher returned after the workers)
    prefix = (tmp_path / "shm-prefix").read_text()
    assert prefix.startswith("/dev/shm/sw-"), prefix
    assert glob.glob(glob.escape(prefix) + "*") == []
