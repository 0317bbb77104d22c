"""``Pipeline.from_model`` and profile-based partitions on 2 gloo ranks: one torchrun job runs every check of
tests/workers/from_model_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

import pytest
from from_model_checks import checks

from _mp import SuiteResults, run_suite

RANKS = 2
NAMES = [name for name in checks(RANKS) if name != "balance"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
    return run_suite("from_model_checks", RANKS, tmp_path_factory.mktemp("from_model2"), timeout=420)


@pytest.mark.parametrize("name", NAMES)
def test_check(results: SuiteResults, name: str) -> None:
    results.get(name)


def test_time_partition_balances_measured_busy_time(results: SuiteResults, record_property) -> None:
    """A deliberately unbalanced model: with partition="time" the ranks' busy times are within 20 % of each other
    (2x on an oversubscribed CPU, see from_model_checks.balance); with "uniform" they are far apart."""
    figures = results.get("balance")[0]["info"]
    for how in ("time", "uniform"):
        f = figures[how]
        print(
            f"\n{how:>7}: blocks per stage {f['blocks per stage']}; busy ms per rank {f['busy ms']} "
            f"(max/min {f['busy max/min']}); CPU ms per rank {f['cpu ms']} (max/min {f['cpu max/min']}); "
            f"busy wall / CPU {f['wall/cpu']}; step {f['step ms']} ms"
            + (f", simulated {f['simulated step ms']} ms" if "simulated step ms" in f else "")
        )
        record_property(f"{how} busy max/min", f["busy max/min"])
        record_property(f"{how} cpu max/min", f["cpu max/min"])
    time_, uniform = figures["time"], figures["uniform"]
    print(f"bounds applied: busy {time_['busy bound']}, CPU {time_['cpu bound']}")
    assert time_["cpu max/min"] <= time_["cpu bound"] and time_["busy max/min"] <= time_["busy bound"]
    assert min(uniform["cpu max/min"], uniform["busy max/min"]) >= 2.0
