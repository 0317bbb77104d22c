"""Stages built empty for a re-layout (``frontends.layers.built_empty``): a spec is built on ``meta`` and given
storage, with no initialisation computed, unless its state would not be whole (then built as usual)."""

from __future__ import annotations

from typing import Any

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


class Tied(nn.Module):
    """A model built whole: a tied embedding and head, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freq", torch.arange(3.0), persistent=False)


def test_meta_twin_keeps_structure_ties_and_transient_buffers() -> None:
    from stagewise.runtime.frontends.meta_twin import meta_twin

    model: Any = Tied()
    model.head.register_forward_hook(lambda m, a, out: out)  # a user's hook: kept
    twin: Any = meta_twin(model)
    assert all(p.is_meta for p in twin.parameters())
    assert twin.head.weight is twin.embed.weight  # the tie holds
    assert not twin.freq.is_meta and torch.equal(twin.freq, model.freq)  # no state moves it: copied
    assert len(twin.head._forward_hooks) == 1
    assert not model.embed.weight.is_meta  # the model itself untouched


def test_given_storage_only_inside_built_empty_and_keeps_ties() -> None:
    from stagewise.runtime.frontends.meta_twin import given_storage, meta_twin

    twin: Any = meta_twin(Tied())
    given_storage([twin.embed], twin, "cpu")
    assert twin.embed.weight.is_meta  # outside built_empty: nothing
    with built_empty():
        given_storage([twin.embed], twin, "cpu")
    assert not twin.embed.weight.is_meta and twin.head.weight is twin.embed.weight
    assert torch.equal(twin.embed.weight, torch.zeros(5, 3))  # zeroed, never initialised


def test_given_storage_refuses_a_freed_transient_buffer() -> None:
    from stagewise.runtime.frontends.meta_twin import given_storage

    model = Tied()
    model.freq = torch.empty(3, device="meta")
    with built_empty():
        try:
            given_storage([model], model, "cpu")
        except ValueError as err:
            assert "non-persistent buffer 'freq'" in str(err)
        else:
            raise AssertionError("a freed non-persistent buffer was given empty storage")


def test_freeing_other_stages_keeps_ties() -> None:
    """A tie freed on a rank holding neither use stays one meta tensor, so a re-layout still finds it."""
    from stagewise.runtime.frontends.from_model import free_other_stages

    model = Tied()
    free_other_stages(model, set())
    assert model.embed.weight.is_meta and model.head.weight is model.embed.weight


class SharedInside(nn.Module):
    """Two submodules holding one weight (a tie inside a layer), and BatchNorm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight
        self.bn = nn.BatchNorm1d(3)


def test_a_lent_tensor_becomes_the_layer_s_own_without_a_second_allocation() -> None:
    """A kept tensor of the right shape, dtype and device goes from meta to the old storage (a tie stays one
    tensor, taking it once); one of another shape, or one not lent, gets new storage; layers not lent, none."""
    old = {"a.weight": torch.randn(3, 3), "bn.running_mean": torch.randn(3), "bn.running_var": torch.zeros(2)}
    asked: list[int] = []

    def lend(index: int) -> dict[str, torch.Tensor]:
        asked.append(index)
        return old if index == 4 else {}

    with built_empty(lend):
        m = build_stage_layer(sw.Layer(SharedInside), 4, 0, torch.device("cpu"))
        other = build_stage_layer(sw.Layer(SharedInside), 5, 0, torch.device("cpu"))
    assert asked == [4, 5]
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, nn.Parameter)
    assert m.a.weight.data_ptr() == old["a.weight"].data_ptr()
    assert m.bn.running_mean.data_ptr() == old["bn.running_mean"].data_ptr()
    assert m.bn.running_var.shape == (3,) and m.bn.running_var.data_ptr() != old["bn.running_var"].data_ptr()
    assert all(not t.is_meta for t in m.state_dict().values())
    assert other.a.weight.data_ptr() != old["a.weight"].data_ptr()
    with built_empty():  # nothing lent: every tensor new, as before
        fresh = build_stage_layer(sw.Layer(SharedInside), 4, 0, torch.device("cpu"))
    assert fresh.a.weight.data_ptr() != old["a.weight"].data_ptr() and fresh.a.weight is fresh.b.weight
