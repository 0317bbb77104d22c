"""The runtime on 2 gloo ranks: every schedule against the one-process model, and the features, once per
transport (torch.distributed point-to-point and same-host shared memory).

One torchrun job per transport runs every check (tests/workers/runtime_checks.py) in one process group; each
test below asserts one check's result on every rank.
"""

from __future__ import annotations

import pytest

from _mp import TRANSPORTS, feature_checks, parity_checks, run_suite, selected

RANKS = 2
PARITY = list(parity_checks(RANKS))
FEATURES = list(feature_checks(RANKS))


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    only = selected(request)
    return run_suite(
        "runtime_checks",
        RANKS,
        tmp_path_factory.mktemp(f"runtime2-{request.param}"),
        timeout=240,
        suite="parity+features+transport",
        env={"STAGEWISE_TRANSPORT": request.param},
        only=None if only is None else [*only, "transport-in-use"],
    )


def test_transport_in_use(results) -> None:
    """The job ran on the transport its STAGEWISE_TRANSPORT names."""
    results.assert_transport()


def test_step_exchanges(results) -> None:
    """The transport's broadcast and all-reduce give every rank the same, expected values (three rounds)."""
    results.assert_ok("step-exchanges")


@pytest.mark.parametrize("name", PARITY)
def test_parity(results, name: str) -> None:
    results.assert_ok(name)


@pytest.mark.parametrize("name", FEATURES)
def test_feature(results, name: str) -> None:
    results.assert_ok(name)
