"""The count on the meta device runs a layer that repeats the one before only once (issue 49 item 1's default cut:
a 32-layer model counted in the time of one layer): a repeat is matched by value, never by a guess, and its count
is the one the layer would have had."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from stagewise.runtime.measure import counting
from stagewise.runtime.measure.counting import count_layers


class _Block(nn.Module):
    """A layer whose forward's work depends on ``window`` and ``act`` but not on ``layer_idx``; counts its calls."""

    calls: ClassVar[list[int]] = []

    def __init__(self, layer_idx: int, window: int = 4, act: Any = None, width: int = 8) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.window = window
        self.act = act or functools.partial(torch.nn.functional.gelu, approximate="tanh")
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Block.calls.append(self.layer_idx)
        y = self.act(self.lin(x))
        return y + y[..., : self.window].sum(-1, keepdim=True).expand_as(y) * (self.window > 2)


def _count(layers: list[nn.Module], width: int = 8, *, repeats: bool = True) -> tuple[list[Any], list[int]]:
    _Block.calls.clear()
    names = [f"l{k}" for k in range(len(layers))]
    with pytest.MonkeyPatch.context() as mp:
        if not repeats:
            mp.setattr(counting, "_work_key", lambda module, args: None)
        counted = count_layers(names, lambda k: layers[k], torch.randn(2, width))
    return counted, list(_Block.calls)


def test_a_repeated_layer_runs_once_and_counts_as_it_would_have() -> None:
    """Four blocks differing only in ``layer_idx`` (each with its own, equal, ``functools.partial``): one forward,
    and every count equal to the count of each run alone, under its own name."""
    counted, calls = _count([_Block(k) for k in range(4)])
    alone, every = _count([_Block(k) for k in range(4)], repeats=False)
    assert calls == [0] and every == [0, 1, 2, 3]
    assert counted == alone
    assert [c.name for c in counted] == ["l0", "l1", "l2", "l3"]
    assert counted[0].forward_flops > 0 and counted[0].backward_flops > 0


def test_layers_that_differ_in_what_they_do_are_each_counted() -> None:
    """A window of another size, a partial with other keywords, another width (so another input for the next):
    each such layer runs; a layer like one seen two layers back runs too only when its input differs."""
    exact = functools.partial(torch.nn.functional.gelu, approximate="none")
    layers: list[nn.Module] = [_Block(0), _Block(1, window=2), _Block(2), _Block(3, act=exact), _Block(4)]
    counted, calls = _count(layers)
    alone, _ = _count(layers, repeats=False)
    assert calls == [0, 1, 3] and counted == alone  # layers 2 and 4 repeat layer 0 on the same input
    assert dataclasses.replace(counted[1], name="l0") != counted[0]  # (the window's work shows in the count)
    widths = [_Block(0, width=8), nn.Linear(8, 4), _Block(2, width=4), _Block(3, width=4)]
    counted, calls = _count(widths)
    assert calls == [0, 2] and counted == _count(widths, repeats=False)[0]


def test_an_attribute_without_a_value_to_compare_is_never_matched() -> None:
    """An object with neither contents nor a call (``object()``), and one nested deeper than the key looks: the
    layers are counted, each."""
    deep: Any = 0
    for _ in range(8):
        deep = [deep]
    for extra in (object(), deep):
        layers = [_Block(k) for k in range(3)]
        for layer in layers:
            layer.extra = extra
        assert _count(layers)[1] == [0, 1, 2]


def test_a_class_names_its_position_attributes() -> None:
    """``position_attributes`` leaves a class's own index fields out of the key (stagewise's HFStage: its range);
    without it they tell the layers apart."""

    class Ranged(_Block):
        position_attributes: ClassVar[frozenset[str]] = frozenset({"start"})

    def made(cls: type[_Block]) -> list[nn.Module]:
        out = []
        for k in range(3):
            layer = cls(k)
            layer.start = k
            out.append(layer)
        return out

    assert _count(made(Ranged))[1] == [0]
    assert _count(made(_Block))[1] == [0, 1, 2]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "gpt2"])
def test_a_hugging_face_model_s_units_count_as_each_alone(family: str) -> None:
    """``from_hf``'s units (the embedding with the first, the head with the last; gemma2 and gemma3 alternate
    sliding-window and full attention): the same counts with repeats matched as with every unit run."""
    pytest.importorskip("transformers")
    from helpers.hf_families import build, padded_batch
    from stagewise.runtime.frontends.hf.discover import recognise
    from stagewise.runtime.frontends.hf.stage import decoder_units

    model = build(family, 6)
    units = [u for _, u in decoder_units(model, recognise(model))]
    (ids, mask), _ = padded_batch(3, 0)
    names = [str(k) for k in range(len(units))]
    with pytest.MonkeyPatch.context() as mp:
        matched = count_layers(names, lambda k: units[k], (ids, mask))
        mp.setattr(counting, "_work_key", lambda module, args: None)
        alone = count_layers(names, lambda k: units[k], (ids, mask))
    assert matched == alone
