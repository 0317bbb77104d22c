"""``pipe.relayout(...)`` on 2 gloo ranks (tests/distributed/workers/relayout2_checks.py, in the shared 2-rank job):
a partition moved at the same pp (then trained through ``train_stream``), 1f1b -> zb-v -> interleaved-1f1b ->
1f1b, pp 2 -> dp 2 -> pp 2; each exact, bit for bit, against a fresh job of the new layout loaded from a
checkpoint saved just before (tied weights, BatchNorm, Adam and its step)."""

from __future__ import annotations

import pytest

from helpers.torchrun import Share, SuiteResults, shared_job
from relayout2_checks import checks

NAMES = list(checks(2))


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"STAGEWISE_RELAYOUT_DIR": str(tmp_path_factory.mktemp("relayout2")), "PYTHONWARNINGS": "ignore"}


SHARE = Share("relayout2_checks", tuple(NAMES), timeout=180, env=_env, ranks=2)  # in the shared 2-rank job
results = shared_job(SHARE)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    results.assert_ok(name)


def test_compared_on_both_ranks(results: SuiteResults) -> None:
    """Each re-layout compared state on both ranks (a check that compared nothing fails)."""
    for rank, row in results.get("schedules").items():
        assert all(row["info"][tag]["compared"] > 0 for tag in ("zbv", "interleaved", "back-1f1b")), (rank, row)
    for rank, row in results.get("pp2-dp2").items():
        assert row["info"]["dp2"]["compared"] > 0 and row["info"]["pp2"]["compared"] > 0, (rank, row)
