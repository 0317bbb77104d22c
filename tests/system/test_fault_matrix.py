"""The fault matrix, sampled: {SIGKILL, SIGSTOP, exception} x {rank 0, a middle rank, the last rank} x {train_step,
the constructor, clip, eval_step, checkpoint save, checkpoint load, an asynchronous train_stream window, a HetPipe
wave}, at 4 ranks with rank 0 hosting the store and a pipeline timeout of 10 s.

Every value of every axis is covered by the eight cases below (one per place; each fault and each victim at
least twice), two jobs at a time, in ``make faults`` (``STAGEWISE_FAULTS=1``: ``make test`` skips these jobs, a minute
and a half); the whole product (72 cases) is ``make fault-matrix``, and a soak of random
cases is ``benchmarks/fault_soak.py`` (their figures are in benchmarks/RESULTS.md). Each case is judged on exit
codes and messages only (tests/system/scripts/fault_harness.py): every live rank exits 1 with a PipelineError
whose first line blames the victim (or the unreachable coordinator), no rank aborts, none hangs. A torchrun job
checks that its summary names the rank that raised as the root cause.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fault_harness as fh

SAMPLE: list[fh.Case] = [
    ("sigstop", 1, "step"),  # rank 3 waits for rank 2, which waits for the stopped rank 1: rank 1 is blamed
    ("exception", 0, "constructor"),
    ("sigkill", 3, "clip"),
    ("sigkill", 0, "eval"),  # the store host dies: the coordinator is unreachable
    ("sigstop", 3, "save"),  # the others wait for it to finish writing: it stopped, it is named
    ("sigkill", 1, "load"),
    ("sigstop", 0, "stream"),
    ("exception", 1, "wave"),
]


def test_the_sample_covers_every_axis_value() -> None:
    assert {c[0] for c in SAMPLE} == set(fh.FAULTS)
    assert {c[1] for c in SAMPLE} == set(fh.VICTIMS)
    assert sorted(c[2] for c in SAMPLE) == sorted(fh.WHERES)
    assert set(SAMPLE) <= set(fh.ALL_CASES)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[fh.Case, fh.Outcome]:
    out = tmp_path_factory.mktemp("matrix")
    return {o.case: o for o in fh.run_cases(SAMPLE, out, parallel=2)}


@pytest.mark.parametrize("case", SAMPLE, ids=[f"{f}-rank{v}-{w}" for f, v, w in SAMPLE])
@pytest.mark.skipif(not os.environ.get("STAGEWISE_FAULTS"), reason="4-rank fault jobs: `make faults`")
def test_fault_case(outcomes: dict[fh.Case, fh.Outcome], case: fh.Case) -> None:
    o = outcomes[case]
    assert not o.problems, "\n".join(o.problems) + "\n" + fh.describe(o)


@pytest.mark.parametrize(
    ("text", "rank"),
    [
        ("global rank 1 stopped or died (no sign of life for 10.5 s); rank 3 waited 10.2 s for ...", 1),
        ("rank 1 (global rank 3): ValueError: the tripwire fired (wave)\nrank 1 at ...", 3),
        ("rank 1 (global rank 3: pp=1 dp=1 sharding=0 tp=0) at 1F2: ValueError", 3),
        ("pipeline rank 1 (global rank 3: pp=1 dp=1 sharding=0 tp=0) at 1F2: ValueError", 3),
        ("rank 2 waited 10.0 s for stage 1's output from rank 1; is another rank stuck or dead?", 2),
        ("the coordinator (store host, rank 0) is unreachable (seen by rank 2): TimeoutError", 0),
        ("no rank at all", None),
    ],
)
def test_the_judge_reads_the_first_rank_of_the_first_line(text: str, rank: int | None) -> None:
    assert fh.blamed(text) == rank


def test_torchrun_summary_names_the_rank_that_raised(tmp_path: Path) -> None:
    """Rank 1 raises in a step; the others stop on the board. torchrun's root cause must be rank 1 with exit code 1
    (not a rank that aborted at exit), and no rank aborts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--max-restarts=0"]
    cmd += [str(fh.WORKER), "--fault", "exception", "--victim", "1", "--where", "step", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=fh.hang_guard(fh.TIMEOUT), env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "terminate called" not in log and "Fatal Python error" not in log, log[-3000:]
    root = re.search(r"Root Cause \(first observed failure\):(.*?)(?:={10,}|$)", log, re.S)
    assert root is not None, log[-3000:]
    assert re.search(r"rank\s*:\s*1 ", root.group(1)) and re.search(r"exitcode\s*:\s*1 ", root.group(1)), root.group(1)
    assert "ValueError: the tripwire fired (step)" in (tmp_path / "rank1.txt").read_text()
