"""torch.distributed.pipelining and stagewise, both ways, on 2 gloo ranks (tests/distributed/workers/
torch_interop_checks.py, in the shared 2-rank job): every registered synchronous schedule and two synthesized ones on
torch's ``_PipelineScheduleRuntime``, torch's classes' orders on ``sw.Pipeline``; float64, exact against one
process. ``make torch-grid`` runs the whole grid (2 and 4 ranks, m in {p, 2p}, every v, both CSV formats,
both readings of torch's classes).

Supported: torch 2.13; skipped, saying why, on a torch without ``_PipelineScheduleRuntime``.
"""

from __future__ import annotations

import os

import pytest

from helpers.torchrun import Share, SuiteResults, suites_by_ranks
from stagewise.runtime.interop import torch_pipelining_missing
from torch_interop_checks import checks

pytestmark = pytest.mark.skipif(torch_pipelining_missing() is not None, reason=str(torch_pipelining_missing()))

GRID = os.environ.get("STAGEWISE_TORCH_GRID") == "1"
RANKS = (2, 4) if GRID else (2,)
CASES = [(ranks, name) for ranks in RANKS for name in checks(ranks)]

#: at 2 ranks in the shared 2-rank job (the grid: jobs of its own)
SHARE = () if GRID or torch_pipelining_missing() else (Share("torch_interop_checks", tuple(checks(2)), 240, ranks=2),)
suites = suites_by_ranks("torch_interop_checks", "torch-interop", timeout=1800 if GRID else 240, shared=SHARE)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_both_ways(suites, ranks: int, name: str) -> None:
    results: SuiteResults = suites(ranks)
    results.assert_ok(name)
