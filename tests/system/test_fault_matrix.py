"""Fault handling when rank 0 - the store host - is the one in trouble (issue 17), at 4 ranks.

A representative subset of the matrix {SIGKILL, SIGSTOP, exception} x {rank 0, a middle rank, the last rank} x
{during a step, in the constructor, in clip_grad_norm_} runs here, two jobs at a time; the whole matrix runs in
``benchmarks/fault_soak.py``. Each case is judged on exit codes and messages only
(tests/system/scripts/fault_harness.py): every live rank exits 1 with a PipelineError naming the faulty rank (or
the unreachable coordinator), no rank aborts. A torchrun job checks that its summary names the rank that raised
as the root cause.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fault_harness as fh

SUBSET: list[fh.Case] = [
    ("sigstop", 0, "step"),
    ("sigkill", 0, "step"),
    ("exception", 0, "constructor"),
    ("exception", 3, "clip"),
    ("sigstop", 3, "clip"),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[fh.Case, fh.Outcome]:
    out = tmp_path_factory.mktemp("matrix")
    return {o.case: o for o in fh.run_cases(SUBSET, out, parallel=2)}


@pytest.mark.parametrize("case", SUBSET, ids=[f"{f}-rank{v}-{w}" for f, v, w in SUBSET])
def test_fault_case(outcomes: dict[fh.Case, fh.Outcome], case: fh.Case) -> None:
    o = outcomes[case]
    detail = "\n".join(f"--- rank {r} (exit {o.codes.get(r)}) ---\n{o.reports.get(r, '')[:1500]}" for r in range(4))
    assert not o.problems, "\n".join(o.problems) + "\n" + detail


def test_torchrun_summary_names_the_rank_that_raised(tmp_path: Path) -> None:
    """Rank 1 raises in a step; the others stop on the board. torchrun's root cause must be rank 1 with exit code 1
    (not a rank that aborted at exit), and no rank aborts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--max-restarts=0"]
    cmd += [str(fh.WORKER), "--fault", "exception", "--victim", "1", "--where", "step", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=fh.HANG_GUARD_S, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "terminate called" not in log and "Fatal Python error" not in log, log[-3000:]
    root = re.search(r"Root Cause \(first observed failure\):(.*?)(?:={10,}|$)", log, re.S)
    assert root is not None, log[-3000:]
    assert re.search(r"rank\s*:\s*1 ", root.group(1)) and re.search(r"exitcode\s*:\s*1 ", root.group(1)), root.group(1)
    assert "ValueError: the tripwire fired (step)" in (tmp_path / "rank1.txt").read_text()
