"""The runtime on 4 gloo ranks: every schedule against the one-process model, and pipelines on subgroups, once
per transport (torch.distributed point-to-point and same-host shared memory).

One torchrun job runs every check (tests/distributed/workers/runtime_checks.py) once per transport in one process group;
each test below asserts one check's result on every rank.
"""

from __future__ import annotations

import pytest

from helpers.torchrun import suite_per_transport
from runtime_checks import parity_checks

RANKS = 4
PARITY = list(parity_checks(RANKS))


results = suite_per_transport("runtime_checks", RANKS, "parity+subgroups+agreement+transport", timeout=270)


def test_transport_in_use(results) -> None:
    """The job ran on the transport its STAGEWISE_TRANSPORT names."""
    results.assert_transport()


def test_step_exchanges(results) -> None:
    """The transport's broadcast and all-reduce give every rank the same, expected values (three rounds)."""
    results.assert_ok("step-exchanges")


@pytest.mark.parametrize("name", PARITY)
def test_parity(results, name: str) -> None:
    results.assert_ok(name)


@pytest.mark.parametrize("name", ["different-options", "different-layout", "alike-per-group", "different-weights"])
def test_ranks_built_alike_or_refused(results, name: str) -> None:
    """Ranks given other options than their pipeline's peers are refused on every rank, naming the option and
    who holds what, before any group is made; pipelines on different groups may differ."""
    results.assert_ok(name)


def test_pipelines_on_subgroups(results) -> None:
    """Groups {0, 2} and {1, 3}: group ranks are not global ranks, and the group is not WORLD."""
    results.assert_ok("subgroups")
