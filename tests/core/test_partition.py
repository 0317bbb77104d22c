"""The partitioner is exact: it matches brute force, respects memory caps and device speeds; the partition
modes (uniform, time, memory) turn a profile into layer counts per stage."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.examples import examples
from helpers.profiles import fake_profile
from stagewise.partition import layer_memory, partition_costs, stage_counts, uniform_counts


def _brute_force(costs, p, speeds=None, extra=None, memory=None, caps=None):
    n = len(costs)
    speeds = speeds or [1.0] * p
    extra = extra or [0.0] * p
    best = math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for k in range(p):
            a, b = bounds[k], bounds[k + 1]
            if memory is not None and sum(memory[a:b]) > caps[k]:
                worst = math.inf
                break
            worst = max(worst, (sum(costs[a:b]) + extra[k]) / speeds[k])
        best = min(best, worst)
    return best


costs_st = st.lists(st.integers(0, 50).map(float), min_size=1, max_size=9)


@settings(max_examples=examples(150), deadline=None)
@given(costs=costs_st, data=st.data())
def test_matches_brute_force(costs: list[float], data: st.DataObject) -> None:
    p = data.draw(st.integers(1, len(costs)))
    speeds = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=p, max_size=p))
    extra = data.draw(st.lists(st.integers(0, 20).map(float), min_size=p, max_size=p))
    result = partition_costs(costs, p, speeds=speeds, extra=extra)
    assert result.bottleneck == pytest.approx(_brute_force(costs, p, speeds, extra))
    assert sum(result.counts) == len(costs) and min(result.counts) >= 1


@settings(max_examples=examples(150), deadline=None)
@given(costs=costs_st, data=st.data())
def test_memory_caps_are_respected_or_rejected(costs: list[float], data: st.DataObject) -> None:
    p = data.draw(st.integers(1, len(costs)))
    memory = data.draw(st.lists(st.integers(0, 10).map(float), min_size=len(costs), max_size=len(costs)))
    caps = data.draw(st.lists(st.integers(0, 30).map(float), min_size=p, max_size=p))
    expected = _brute_force(costs, p, memory=memory, caps=caps)
    if expected == math.inf:
        with pytest.raises(ValueError, match="fits the memory caps"):
            partition_costs(costs, p, memory=memory, memory_caps=caps)
        return
    result = partition_costs(costs, p, memory=memory, memory_caps=caps)
    assert result.bottleneck == pytest.approx(expected)
    for k in range(p):
        a, b = result.bounds[k], result.bounds[k + 1]
        assert sum(memory[a:b]) <= caps[k]


def test_a_half_speed_device_gets_about_half_the_work() -> None:
    result = partition_costs([1.0] * 30, 2, speeds=[1.0, 0.5])
    assert result.counts == [20, 10]
    assert result.stage_costs == (20.0, 20.0)


def test_extra_cost_on_the_last_stage_moves_layers_off_it() -> None:
    assert partition_costs([1.0] * 8, 2, extra=[0.0, 2.0]).counts == [5, 3]


def test_unbalanced_costs() -> None:
    result = partition_costs([8, 1, 1, 1, 1, 1, 1, 1, 1], 3)
    assert result.bottleneck == 8 and result.counts[0] == 1
    assert result.stage_of(0) == 0 and result.stage_of(8) == 2


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="4 stages need at least 4 layers, got 3"):
        partition_costs([1, 1, 1], 4)
    with pytest.raises(ValueError, match="speeds has 1 entries, expected one per stage"):
        partition_costs([1, 1, 1], 2, speeds=[1.0])
    assert uniform_counts(10, 4) == [3, 3, 2, 2]


# ---- the partition modes: counts from a profile's costs --------------------------------------------------
def test_time_balances_the_profile_and_a_half_speed_stage_gets_half_the_work() -> None:
    prof = fake_profile([1.0] * 12)
    assert stage_counts(12, 2, "time", profile=prof) == [6, 6]
    assert stage_counts(12, 2, "time", profile=prof, speeds=[1.0, 0.5]) == [8, 4]
    assert stage_counts(12, 3, "time", profile=prof, speeds=[1.0, 1.0, 0.5]) == [5, 5, 2]
    skewed = fake_profile([1.0] * 8 + [10.0] * 4)
    assert stage_counts(12, 2, "uniform") == [6, 6]
    assert stage_counts(12, 2, "time", profile=skewed) == [10, 2]


def test_memory_balances_bytes_and_caps_bind() -> None:
    prof = fake_profile([1.0] * 6, params=[10, 10, 10, 10, 100, 100], acts=[5] * 6)
    memory = layer_memory(prof, in_flight=2)
    assert memory == [30, 30, 30, 30, 210, 210]  # 2 x parameters + 2 micro-batches of activations
    assert stage_counts(6, 2, "memory", profile=prof, in_flight=2) == [5, 1]
    # time alone would cut [3, 3]; a 100-byte cap on the first stage leaves it 3 layers at most (90 bytes)
    assert stage_counts(6, 2, "time", profile=prof, in_flight=2, memory_caps=[100, 1e9]) == [3, 3]
    assert stage_counts(6, 2, "time", profile=prof, in_flight=2, memory_caps=[70, 1e9]) == [2, 4]
    with pytest.raises(ValueError, match="fits the memory caps .* 2 micro-batch"):
        stage_counts(6, 2, "memory", profile=prof, in_flight=2, memory_caps=[100, 100])


def test_the_last_stage_holds_what_the_loss_keeps() -> None:
    """``loss_bytes`` (a language model's log-softmax of its logits) sits on the last layer's stage, for as many
    micro-batches as its activations: a cap that fits the layers alone may not fit them with the loss."""
    prof = replace(fake_profile([1.0] * 6, params=[10] * 6, acts=[5] * 6), loss_bytes=40.0)
    assert layer_memory(prof, in_flight=2) == [30, 30, 30, 30, 30, 110]
    assert stage_counts(6, 2, "memory", profile=prof, in_flight=2) == [4, 2]
    caps = [1e9, 120.0]  # the last rank holds 4 layers without the loss, with it the last layer only
    assert stage_counts(6, 2, "time", profile=replace(prof, loss_bytes=0.0), in_flight=2, memory_caps=caps) == [3, 3]
    assert stage_counts(6, 2, "time", profile=prof, in_flight=2, memory_caps=caps) == [5, 1]


def test_partition_options_are_refused_clearly() -> None:
    prof = fake_profile([1.0] * 4)
    with pytest.raises(ValueError, match="must be 'balanced', 'uniform', 'parameters', 'time', 'memory'"):
        stage_counts(4, 2, "fast")
    with pytest.raises(ValueError, match="partition='uniform' does not"):
        stage_counts(4, 2, "uniform", speeds=[1, 2])
    with pytest.raises(ValueError, match="explicit counts do not"):
        stage_counts(4, 2, [2, 2], memory_caps=[1, 1])
    with pytest.raises(ValueError, match="speeds= does not change"):
        stage_counts(4, 2, "memory", profile=prof, speeds=[1, 2])
    with pytest.raises(ValueError, match="partition='time' needs a profile of the blocks"):
        stage_counts(4, 2, "time", unit="block")
    with pytest.raises(ValueError, match="the profile has 4 entries, but there are 5 layers"):
        stage_counts(5, 2, "time", profile=prof)
    with pytest.raises(ValueError, match="3 stages need at least 3 blocks, got 2"):
        stage_counts(2, 3, "time", profile=prof, unit="block")
