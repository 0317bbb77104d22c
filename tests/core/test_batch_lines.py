"""The planner's per-micro-batch costs (issue 49 item 5): profiles at several micro-batch sizes become a line per
layer (a fixed part and a part that scales), the same costs the held-out prediction takes from each size."""

from __future__ import annotations

import pytest

from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import plan
from stagewise.planning.comm import Link
from stagewise.planning.costing import batch_lines, layer_arrays, stage_base
from stagewise.planning.inputs import make_problem

#: per layer (F fixed, F per sample, B fixed, B per sample), seconds: a fixed part as a layer call has
LINES = [(0.5, 1.0, 1.0, 2.0), (0.25, 2.0, 0.75, 4.0), (0.0, 1.0, 0.5, 3.0)]


def at(batch: int) -> LayerProfile:
    """The layers of :data:`LINES` profiled at ``batch`` samples (I and W half of B each; bytes linear)."""
    layers = []
    for k, (f0, f1, b0, b1) in enumerate(LINES):
        f, b = f0 + f1 * batch, b0 + b1 * batch
        layers.append(LayerCost(f"l{k}", f, b / 2, b / 2, b, 8.0 * batch, 4.0 * batch, 100.0, 16.0 * batch))
    return LayerProfile(layers=tuple(layers), device="cpu", repeats=1, warmup=0, batch=batch)


def test_two_or_more_sizes_give_each_layer_its_line() -> None:
    lines = batch_lines([at(1), at(2), at(4)])
    assert lines.forward == pytest.approx((0.5, 0.25, 0.0), abs=1e-12)
    assert lines.backward == pytest.approx((1.0, 0.75, 0.5), rel=1e-12)
    slopes = lines.profile.layers  # at the first profile's batch (1 sample)
    assert [x.forward for x in slopes] == pytest.approx([1.0, 2.0, 1.0], rel=1e-12)
    assert [x.backward for x in slopes] == pytest.approx([2.0, 4.0, 3.0], rel=1e-12)
    assert [x.backward_input for x in slopes] == pytest.approx([1.0, 2.0, 1.5], rel=1e-12)
    assert lines.profile.layers[0].activation_bytes == 8.0  # bytes as profiled


def test_the_planner_prices_each_micro_batch_as_its_profile_does() -> None:
    """Cut [1 | 2], a micro-batch of b samples: every stage's F, B, I and W equal the sums of the layers profiled
    at b (linear scaling of the 1-sample profile would charge layer 0's F at 4 samples 6 s, not 4.5)."""
    prob = make_problem(at(1), 2, global_batch=8, profiles=[at(2), at(4)])
    base = stage_base(
        layer_arrays(prob.profile, 1, frozenset()), [0, 1, 3], tp=1, tp_link=Link(), recompute=None,
        overhead=prob.overhead, backward_overhead=prob.backward_overhead,
    )  # fmt: skip
    for b in (1, 2, 4, 3):
        truth, got = at(b), base.at(b / prob.profile_batch)
        for s, (lo, hi) in enumerate([(0, 1), (1, 3)]):
            layers = truth.layers[lo:hi]
            assert got.forward[s] == pytest.approx(sum(x.forward for x in layers), rel=1e-12)
            assert got.backward_times()[s] == pytest.approx(sum(x.backward for x in layers), rel=1e-12)
            assert got.backward_input[s] == pytest.approx(sum(x.backward_input for x in layers), rel=1e-12)
            assert got.backward_weight[s] == pytest.approx(sum(x.backward_weight for x in layers), rel=1e-12)
    linear = make_problem(at(1), 2, global_batch=8)
    plain = stage_base(layer_arrays(linear.profile, 1, frozenset()), [0, 1, 3], tp=1, tp_link=Link(),
                       recompute=None, overhead=linear.overhead)  # fmt: skip
    assert plain.at(4.0).forward[0] == 6.0 and base.at(4.0).forward[0] == pytest.approx(4.5, rel=1e-12)


def test_a_negative_fixed_part_is_a_line_through_the_origin() -> None:
    """F 1 s at 1 sample, 3 s at 2: the line through both would start at -1 s; the planner takes the least-squares
    slope through the origin, (1 + 6) / (1 + 4) = 1.4 s a sample, and no fixed part."""
    one, two = at(1), at(2)
    bent = [one.layers[0].__class__(**{**vars(one.layers[0]), "forward": 1.0}),
            two.layers[0].__class__(**{**vars(two.layers[0]), "forward": 3.0})]  # fmt: skip
    p1 = LayerProfile(layers=(bent[0], *one.layers[1:]), device="cpu", repeats=1, warmup=0, batch=1)
    p2 = LayerProfile(layers=(bent[1], *two.layers[1:]), device="cpu", repeats=1, warmup=0, batch=2)
    lines = batch_lines([p1, p2])
    assert lines.forward[0] == 0.0 and lines.profile.layers[0].forward == pytest.approx(1.4, rel=1e-12)


def test_plan_takes_the_profiles_and_refuses_what_it_cannot_line_up() -> None:
    assert plan(at(1), 2, global_batch=8, profiles=[at(2), at(4)])
    with pytest.raises(ValueError, match="distinct recorded batches"):
        make_problem(at(1), 2, global_batch=8, profiles=[at(1)])
    other = LayerProfile(layers=at(2).layers[:2], device="cpu", repeats=1, warmup=0, batch=2)
    with pytest.raises(ValueError, match="the same layers"):
        make_problem(at(1), 2, global_batch=8, profiles=[other])
