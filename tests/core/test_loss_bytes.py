"""The loss's saved tensors in the predictions (LayerProfile.loss_bytes): the last stage holds them from its
forward to its backward, in the simulator's cost model and in the planner's memory, recompute or not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stagewise.partition import LayerProfile
from stagewise.planning import search
from stagewise.planning.synthetic import transformer_profile

LOSS = 1_000_000.0  # far above any layer's activations here, so a missing term cannot hide


@pytest.fixture(scope="module")
def base() -> LayerProfile:
    return transformer_profile(4, hidden=64, seq=32, vocab=256, heads=4)


def test_the_cost_model_puts_the_loss_on_the_last_stage_only(base: LayerProfile) -> None:
    plain, with_loss = base.cost_model([0, 3, 6]), replace(base, loss_bytes=LOSS).cost_model([0, 3, 6])
    assert with_loss.activation_bytes[0] == plain.activation_bytes[0]
    assert with_loss.activation_bytes[1] == plain.activation_bytes[1] + LOSS
    assert with_loss.weight_activation_bytes == plain.weight_activation_bytes  # freed by the last stage's I


@pytest.mark.parametrize("recompute", [None, "stage"])
def test_the_planner_charges_the_last_rank_for_every_micro_batch_in_flight(
    base: LayerProfile, recompute: str | None
) -> None:
    """gpipe at pp = 2, m = 4: the last rank holds all four micro-batches' losses at its peak."""
    options = dict(global_batch=4, profile_batch=1, schedules=["gpipe"], recompute=[recompute], top=1000)

    def plan(profile: LayerProfile):
        found = [p for p in search(profile, 2, **options).plans if p.layout.pp == 2 and p.microbatches == 4]
        assert found, "no gpipe plan of pp = 2, m = 4"
        return found[0]

    plain, with_loss = plan(base), plan(replace(base, loss_bytes=LOSS))
    assert with_loss.memory[0].activations == pytest.approx(plain.memory[0].activations)
    assert with_loss.memory[1].activations == pytest.approx(plain.memory[1].activations + 4 * LOSS)


def test_loss_bytes_round_trip_and_refuse_nonsense(base: LayerProfile) -> None:
    p = replace(base, loss_bytes=1234.0)
    assert LayerProfile.from_json(p.to_json()) == p
    assert LayerProfile.from_json(base.to_json()).loss_bytes == 0.0
    with pytest.raises(ValueError, match="loss_bytes"):
        replace(base, loss_bytes=-1.0)
