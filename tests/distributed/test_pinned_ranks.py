"""Ranks pinned a core each (``stagewise run --pin-cores``) calibrate on the node's cores, not on the one each sees
(issue 49 item 2): two gloo ranks launched through the pinning module, each rank's calibrator gathering the
ranks' affinity. Before, each rank took its own affinity (1 CPU) and modelled the two ranks on one core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "pinned_calibration.py"


@pytest.mark.timeout(180)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning 2 ranks a core each needs 2 CPUs")
def test_pinned_ranks_calibrate_on_the_node_s_cores(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           "-m", "stagewise.runtime.measure.cores", str(WORKER)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PINNED_OUT=str(tmp_path))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    shares = [cpus[r * (len(cpus) // 2) : (r + 1) * (len(cpus) // 2)] for r in range(2)]
    assert [r["own"] for r in rows] == shares, rows
    for row in rows:
        assert row["affinity"] == shares and row["pinned"] is True, row
        assert row["cores"] == float(2 * (len(cpus) // 2)), row
