"""Start a suite of runtime checks once, under torchrun, and read back one result per check and rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))

from runtime_checks import feature_checks, parity_checks  # noqa: E402

__all__ = ["SuiteResults", "feature_checks", "parity_checks", "run_suite"]


@dataclass
class SuiteResults:
    nprocs: int
    by_check: dict[str, dict[int, dict]] = field(default_factory=dict)
    log: str = ""

    def assert_ok(self, name: str) -> None:
        ranks = self.by_check.get(name, {})
        missing = [r for r in range(self.nprocs) if r not in ranks]
        if missing:
            pytest.fail(f"check {name!r} has no result from ranks {missing}; worker log tail:\n{self.log[-6000:]}")
        failed = {r: res["detail"] for r, res in sorted(ranks.items()) if not res["ok"]}
        if failed:
            pytest.fail("\n".join(f"--- rank {r} ---\n{detail}" for r, detail in failed.items()))


def run_suite(suite: str, nprocs: int, out: Path, timeout: float) -> SuiteResults:
    """Run ``suite`` on ``nprocs`` gloo ranks (one torchrun job, every wait bounded) and collect results."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "--max-restarts=0",
        str(WORKERS / "runtime_worker.py"),
        "--suite",
        suite,
        "--out",
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"torchrun timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    results = SuiteResults(nprocs, log=log if isinstance(log, str) else log.decode(errors="replace"))
    for rank in range(nprocs):
        path = out / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            results.by_check.setdefault(row["check"], {})[rank] = row
    return results
