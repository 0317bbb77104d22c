"""`make gpu-check` (``python -m benchmarks.gpu_check``): without a CUDA device it says so and succeeds; with
``--device cpu`` its parts run end to end at small sizes (parity and the host reads meeting their targets) and
print one table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run on it")
def test_without_cuda_it_says_so_and_succeeds() -> None:
    done = _run()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "no CUDA device"


def test_on_the_cpu_parity_and_host_reads_meet_their_targets() -> None:
    done = _run("--device", "cpu", "--parts", "ab", "--strict")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert len(rows) == 6 and all(row.endswith("| yes |") for row in rows), done.stdout
