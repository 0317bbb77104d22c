"""``pipe.relayout(...)`` on 4 gloo ranks (one torchrun job, tests/distributed/workers/relayout_checks.py): after a
re-layout the pipeline equals, bit for bit, a fresh job of the new layout loaded from a checkpoint saved just
before (parameters, buffers, tied copies, Adam's state and step, train_steps, the dropout seed, the next losses):
a partition moved; 1f1b -> zb-v -> interleaved-1f1b -> 1f1b; pp 2 x dp 2 -> pp 4 -> pp 2 x dp 2; pp 2 x dp 2 -> dp 4
-> pp 4 -> dp 4 -> pp 2 x dp 2; 4 -> 2 processes and back; a tagged model and ``from_hf`` (tied) onto 2 processes
and back; ``relayout(plan=...)``; PipeDream, 2BW and XPipe between two windows (dp 4, tagged, from_hf, plan= and the
windows in `make relayout`, not `make test`); bad requests refused alike on every
rank; a process failing midway through the transfers (the same named PipelineError everywhere, the old layout
whole and resumable); no initialisation computed for the new stages; parameters kept on their rank aliased; no
process group of the layout before held by the new one. The 2-process cases: test_relayout_2ranks.py."""

from __future__ import annotations

import os

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from relayout_cases_checks import CHECKS as CASES
from relayout_checks import checks

NAMES = list(checks(4))
#: dp 4, the tagged model, from_hf, plan= and the asynchronous windows run in `make relayout` (CI's time: about
#: 20 s of this job); every other check, the partition, schedules, pp x dp and the shrink among them, in `make test`
EVERY_CASE = bool(os.environ.get("STAGEWISE_RELAYOUT_ALL"))
RUN = [name for name in NAMES if EVERY_CASE or name not in CASES]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    out = tmp_path_factory.mktemp("relayout")
    env = {"STAGEWISE_RELAYOUT_DIR": str(tmp_path_factory.mktemp("ckpt")), "PYTHONWARNINGS": "ignore"}
    env["STAGEWISE_RELAYOUT_LEAKS"] = os.environ.get("STAGEWISE_RELAYOUT_LEAKS", "6")  # 20: make relayout
    # its own job, not the shared one (helpers.torchrun.shared_job): its last check, failure, leaves the failed rank's
    # gloo thread spinning until the released group's timeout (the shared job's checks after it ran 2-3 times slower)
    only = [name for name in selected(request) or RUN if name in RUN]
    return run_suite("relayout_checks", 4, out, timeout=480, env=env, only=only)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    if name not in RUN:
        pytest.skip("a 4-rank case `make relayout` runs (STAGEWISE_RELAYOUT_ALL=1)")
    results.assert_ok(name)


def test_every_rank_compared_something(results: SuiteResults) -> None:
    """The comparisons ran: across the ranks every check compared tensors (a check that compared nothing fails)."""
    for name in ("partition", "shrink-grow"):
        rows = [results.get(name)[r]["info"] for r in range(4)]
        assert all(row is not None for row in rows), name
    aliased = [results.get("partition")[r]["info"]["aliased"] for r in range(4)]
    assert sum(aliased) > 0, f"no parameter stayed on its rank to be aliased: {aliased}"
    fresh = [results.get("partition")[r]["info"]["fresh_inits"] for r in range(4)]
    assert sum(fresh) > 0, f"the initialisation counter counted nothing in the fresh jobs: {fresh}"
    shrink = [results.get("shrink-grow")[r]["info"]["shrink"]["compared"] for r in range(4)]
    assert shrink[0] > 0 and shrink[1] > 0 and shrink[2:] == [0, 0], shrink
    if not EVERY_CASE:
        return
    for name, parts in [("tagged", ("shrink", "grow")), ("from-hf", ("shrink", "grow")), ("dp4", ("dp4", "pp2xdp2"))]:
        for part in parts:
            compared = [results.get(name)[r]["info"][part]["compared"] for r in range(4)]
            assert compared[0] > 0 and compared[1] > 0, (name, part, compared)
    for name in ("pipedream", "pipedream-2bw", "xpipe"):
        compared = [results.get("asynchronous")[r]["info"][name]["compared"] for r in range(4)]
        assert all(c > 0 for c in compared), (name, compared)
