"""``Pipeline.from_model`` and profile-based partitions on 2 and 4 gloo ranks: one torchrun job per rank count
runs every check of tests/workers/from_model_checks.py; each test asserts one check on every rank."""

from __future__ import annotations

import pytest
from from_model_checks import checks

from _mp import suites_by_ranks

CASES = [(2, name) for name in checks(2) if name != "balance"] + [(4, name) for name in checks(4)]

suites = suites_by_ranks("from_model_checks", "from_model", timeout=420)


@pytest.mark.parametrize(("ranks", "name"), CASES, ids=[f"{r}ranks-{n}" for r, n in CASES])
def test_check(suites, ranks: int, name: str) -> None:
    suites(ranks).get(name)


def test_time_partition_balances_measured_busy_time(suites, record_property) -> None:
    """A deliberately unbalanced model on 2 ranks: with partition="time" the ranks' busy times are within 20 % of
    each other (2x on an oversubscribed CPU, see from_model_checks.balance); with "uniform" they are far apart."""
    figures = suites(2).get("balance")[0]["info"]
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
