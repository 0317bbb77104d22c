"""Start a module of multi-process checks once, under torchrun, and read back one result per check and rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from runtime_checks import feature_checks, parity_checks

WORKERS = Path(__file__).parent / "workers"

__all__ = ["SuiteResults", "feature_checks", "parity_checks", "run_suite", "suites_by_ranks"]


@dataclass
class SuiteResults:
    nprocs: int
    by_check: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    log: str = ""

    def get(self, name: str) -> dict[int, dict[str, Any]]:
        """The check's row on every rank; fails the test naming the ranks that failed or never reported."""
        ranks = self.by_check.get(name, {})
        missing = [r for r in range(self.nprocs) if r not in ranks]
        if missing:
            pytest.fail(f"check {name!r} has no result from ranks {missing}; worker log tail:\n{self.log[-6000:]}")
        failed = {r: res["detail"] for r, res in sorted(ranks.items()) if not res["ok"]}
        if failed:
            pytest.fail("\n".join(f"--- rank {r} ---\n{detail}" for r, detail in failed.items()))
        return ranks

    def assert_ok(self, name: str) -> None:
        self.get(name)


def run_suite(
    module: str,
    nprocs: int,
    out: Path,
    timeout: float,
    *,
    suite: str | None = None,
    env: dict[str, str] | None = None,
) -> SuiteResults:
    """Run ``module``'s checks (tests/workers/MODULE.py) on ``nprocs`` gloo ranks in one bounded torchrun job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    cmd += ["--max-restarts=0", str(WORKERS / "worker.py"), "--checks", module, "--out", str(out)]
    if suite is not None:
        cmd += ["--suite", suite]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env or {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"torchrun timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    results = SuiteResults(nprocs, log=log if isinstance(log, str) else log.decode(errors="replace"))
    for rank in range(nprocs):
        path = out / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            results.by_check.setdefault(row["check"], {})[rank] = row
    return results


def suites_by_ranks(module: str, label: str, timeout: float) -> Any:
    """A module-scoped fixture: ``suites(ranks)`` runs ``module``'s checks on that many ranks once, then reuses it.

    For test modules that run the same checks at several rank counts (one torchrun job per count).
    """

    @pytest.fixture(scope="module")
    def suites(tmp_path_factory: pytest.TempPathFactory) -> Any:
        done: dict[int, SuiteResults] = {}

        def get(ranks: int) -> SuiteResults:
            if ranks not in done:
                done[ranks] = run_suite(module, ranks, tmp_path_factory.mktemp(f"{label}{ranks}"), timeout=timeout)
            return done[ranks]

        return get

    return suites
