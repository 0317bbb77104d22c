"""The runtime on 2 gloo ranks: every schedule against the one-process model, and the features, once per
transport (torch.distributed point-to-point and same-host shared memory).

One torchrun job runs every check (tests/distributed/workers/runtime_checks.py) once per transport in one process group
(the checks that leave receives behind last); each test below asserts one check's result on every rank.
"""

from __future__ import annotations

import pytest

from helpers.torchrun import suite_per_transport
from runtime_checks import feature_checks, parity_checks

RANKS = 2
PARITY = list(parity_checks(RANKS))
FEATURES = list(feature_checks(RANKS))


results = suite_per_transport(
    "runtime_checks", RANKS, "parity+features+transport", timeout=240, last=("failure-propagates", "shape-mismatch")
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
