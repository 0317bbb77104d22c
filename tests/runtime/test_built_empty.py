"""Stages built empty for a re-layout (``frontends.layers.built_empty``): a spec is built on ``meta`` and given
storage, with no initialisation computed, unless its state would not be whole (then built as usual)."""

from __future__ import annotations

import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.frontends.layers import build_stage_layer, built_empty


class Counted(nn.Linear):
    """Counts the initialisations computed on a real device."""

    real = 0

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            Counted.real += 1
        super().reset_parameters()


class WithRope(nn.Module):
    """A non-persistent buffer, which no state_dict carries: must be computed, so built as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Counted(2, 2)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)


class NeedsValues(nn.Module):
    """A constructor that reads a value (fails on meta): built as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = Counted(2, 2)
        self.scale = float(torch.ones(1).sum().item())


def test_a_spec_is_built_without_initialisation_on_the_device() -> None:
    Counted.real = 0
    with built_empty():
        m = build_stage_layer(sw.Layer(Counted, 3, 4, dtype=torch.float64), 0, 0, torch.device("cpu"))
    assert Counted.real == 0 and m.weight.device.type == "cpu" and m.weight.dtype == torch.float64
    build_stage_layer(sw.Layer(Counted, 3, 4), 0, 0, None)  # outside: initialised as always
    assert Counted.real == 1


def test_state_that_no_state_dict_carries_is_built_as_usual() -> None:
    Counted.real = 0
    with built_empty():
        rope = build_stage_layer(sw.Layer(WithRope), 0, 0, None)
        needs = build_stage_layer(sw.Layer(NeedsValues), 1, 0, None)
    assert isinstance(rope, WithRope) and isinstance(needs, NeedsValues)
    assert torch.equal(rope.get_buffer("freq"), torch.arange(4.0)) and needs.scale == 1.0
    assert Counted.real == 2  # both built for real


def test_a_module_given_as_is_stays_itself() -> None:
    eager = nn.Linear(2, 2)
    with built_empty():
        assert build_stage_layer(eager, 0, 0, None) is eager
