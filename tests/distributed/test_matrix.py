"""The combination matrix: every way in x every option, on 4 gloo ranks, each cell exact or refused.

One torchrun job runs every cell of tests/distributed/workers/matrix_checks.py; each test below asserts one
cell on every rank: exact against the one-process model (or the replay of an asynchronous rule), or refused
by an error naming the combination before any process group was made. ``matrix_spec`` is the specification
and ``docs/matrix.md`` shows it (checked here, so the docs cannot drift from what is tested).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.torchrun import SuiteResults, run_suite, selected
from matrix_spec import EXACT, SAME_AS, cells, expected, markdown

RANKS = 4
DOCS = Path(__file__).resolve().parents[2] / "docs" / "matrix.md"


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite(
        "matrix_checks",
        RANKS,
        tmp_path_factory.mktemp("matrix"),
        timeout=540,
        env={"PYTHONWARNINGS": "ignore", "MATRIX_DIR": str(tmp_path_factory.mktemp("matrix-checkpoints"))},
        only=selected(request),
    )


@pytest.mark.parametrize("name", [f"{r}-{c}" for r, c in cells()])
def test_cell(results: SuiteResults, name: str) -> None:
    rows = results.get(name)
    row, column = name.split("-", 1)
    refused = {r: (info.get("info") or {}).get("refused") for r, info in rows.items()}
    want = expected(row, column)
    assert all(v == (None if want == EXACT else want) for v in refused.values()), (want, refused)


@pytest.mark.parametrize(
    "name",
    [
        "protocol-async-nan-later-window",
        "protocol-async-batchnorm-deferred",
        "protocol-async-batchnorm-micro",
        "protocol-async-batchnorm-micro-recomputed",
    ],
)
def test_asynchronous_windows_run_the_one_step_protocol(results: SuiteResults, name: str) -> None:
    """Options reach every window of a stream: a NaN in the third window raises on every rank; BatchNorm's
    running statistics follow the policy, equal to the replay of the rule (6 updates for 6 mini-batches
    deferred, 12 for their 12 micro-batches)."""
    results.assert_ok(name)


def test_schedule_auto_is_synthesized_alike_on_every_rank_and_exact(results: SuiteResults) -> None:
    results.assert_ok("protocol-auto-schedule")


def test_tied_groups_of_two_pipelines_in_one_job(results: SuiteResults) -> None:
    results.assert_ok("protocol-tied-groups-twice")


@pytest.mark.parametrize("name", ["protocol-tied-sharding"])
def test_tied_weights_under_sharding_train_exactly(results: SuiteResults, name: str) -> None:
    """Tied weights and sharding together (issue 51): exact against the one-process model."""
    results.assert_ok(name)


def test_a_cell_not_run_again_stands_on_a_trained_exact_cell() -> None:
    """A ``SAME_AS`` cell names a row whose cell of the same column the job trains (exact, not itself skipped)."""
    run = set(cells())
    for (row, column), (trained, why) in SAME_AS.items():
        assert expected(row, column) == EXACT and why, (row, column)
        assert (trained, column) in run and expected(trained, column) == EXACT, (row, column, trained)


def test_the_docs_show_the_tested_matrix() -> None:
    text = DOCS.read_text()
    assert markdown() in text, f"docs/matrix.md must contain the matrix as tested:\n{markdown()}"
