"""Issue 5 part A on 4 gloo ranks: tied parameters, recompute, clipping, aux losses, frozen values, BatchNorm
and measured activation memory vs the simulator; one torchrun job runs tests/workers/feature_checks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _mp import SuiteResults

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from feature_checks import checks  # noqa: E402

RANKS = 4
NAMES = list(checks(RANKS))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    import json

    out = tmp_path_factory.mktemp("features4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    cmd += ["--max-restarts=0", str(WORKERS / "feature_checks.py"), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"torchrun timed out\n{err.stdout or ''}{err.stderr or ''}"
    res = SuiteResults(RANKS, log=log if isinstance(log, str) else log.decode(errors="replace"))
    for rank in range(RANKS):
        path = out / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            res.by_check.setdefault(row["check"], {})[rank] = row
    return res


@pytest.mark.parametrize("name", NAMES)
def test_feature(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)
    if name.startswith("memory-"):
        for rank, row in sorted(results.by_check[name].items()):
            print(f"{name} rank {rank}: {row['info']}")
