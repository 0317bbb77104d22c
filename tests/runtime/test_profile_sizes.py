"""``sw.runtime.profile_sizes``: a profile per micro-batch size, measured in turns so that their ratio is steady."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.frontends import profile as door


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_each_size_is_profiled_on_its_first_samples() -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    got = sw.runtime.profile_sizes(_model(), x, [4, 2, 8], repeats=1, warmup=0, rounds=1,
                                   loss_fn=nn.functional.mse_loss, targets=y)  # fmt: skip
    assert sorted(got) == [2, 4, 8]
    for b, p in got.items():
        assert p.batch == b
        assert p.names == got[8].names
        assert p.layers[0].output_bytes == b * 8 * 4  # the first Linear's float32 output at b samples
        assert p.loss_bytes == pytest.approx(got[8].loss_bytes * b / 8)  # the targets cut with the inputs


def test_the_sizes_take_turns_and_each_layer_keeps_its_fastest_round(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = door.profile

    def fake(model: Any, inputs: Any, **kw: Any) -> sw.LayerProfile:
        calls.append(kw["batch"])
        out = real(model, inputs, repeats=1, warmup=0, batch=kw["batch"])
        k = len(calls)  # the k-th call: layer 0 fastest in the 2nd round of its size, layer 2 in the 3rd
        slow = {0: 1.0 if k in (3, 4) else 5.0, 2: 1.0 if k in (5, 6) else 5.0}
        layers = tuple(replace(c, forward=slow.get(i, 2.0) * b, backward=slow.get(i, 2.0) * b)
                       for i, (c, b) in enumerate((c, kw["batch"]) for c in out.layers))  # fmt: skip
        return replace(out, layers=layers)

    monkeypatch.setattr(door, "profile", fake)
    got = sw.runtime.profile_sizes(_model(), torch.randn(4, 4), [2, 4], rounds=3)
    assert calls == [2, 4, 4, 2, 2, 4]  # in turns, the order reversed each round
    for b in (2, 4):
        assert [c.forward for c in got[b].layers] == [1.0 * b, 2.0 * b, 1.0 * b]


def test_inputs_beyond_the_batch_are_left_whole() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * scale

    inputs = (torch.randn(6, 4), torch.ones(1, 4))
    got = sw.runtime.profile_sizes([Scaled()], inputs, [3, 6], repeats=1, warmup=0, rounds=1)
    assert got[3].batch == 3 and got[3].layers[0].output_bytes == 3 * 4 * 4


@pytest.mark.parametrize(
    ("sizes", "rounds", "match"),
    [([2, 16], 1, "hold 8 samples.*largest of sizes \\[2, 16\\]"), ([0, 2], 1, "sizes must be ints >= 1"),
     ([], 1, "sizes must be ints >= 1"), ([2], 0, "rounds must be an int >= 1"),
     ([2], 1.5, "rounds must be an int >= 1")],
)  # fmt: skip
def test_bad_sizes_are_refused_before_anything_runs(sizes: list[int], rounds: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sw.runtime.profile_sizes(_model(), torch.randn(8, 4), sizes, rounds=rounds)


def test_inputs_without_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="no tensor with a first dimension"):
        sw.runtime.profile_sizes(_model(), (3.0,), [1])


def test_layer_specs_are_built_as_the_pipeline_builds_them() -> None:
    """A dict of ``sw.Layer`` specs, as a Pipeline takes it, is profiled by its names (each spec built once, as
    ``sw.build_model`` builds it); before, iterating the dict handed its keys to the measurement, which failed on a
    ``str``'s ``.parameters()``."""
    specs = {"up": sw.Layer(nn.Linear, 4, 8), "act": sw.Layer(nn.ReLU), "down": sw.Layer(nn.Linear, 8, 2)}
    got = sw.runtime.profile_sizes(specs, torch.randn(4, 4), [2, 4], repeats=1, warmup=0, rounds=1)
    assert got[2].names == got[4].names == ["up", "act", "down"]
    assert got[4].layers[0].parameter_bytes == (4 * 8 + 8) * 4
    assert sw.profile([sw.Layer(nn.Linear, 4, 8), nn.ReLU()], torch.randn(2, 4), repeats=1, warmup=0).names == [
        "0", "1"]  # fmt: skip


@pytest.mark.parametrize("bad", [{"up": nn.Linear(4, 4), "oops": "relu"}, [nn.Linear(4, 4), 3]])
def test_a_layer_that_is_no_module_nor_spec_is_refused_by_name(bad: Any) -> None:
    with pytest.raises(TypeError, match="profile_sizes: layer '(oops|1)' is a (str|int), not an nn.Module"):
        sw.runtime.profile_sizes(bad, torch.randn(4, 4), [2], repeats=1, warmup=0, rounds=1)
    with pytest.raises(TypeError, match="^profile: layer"):
        sw.profile(bad, torch.randn(4, 4), repeats=1, warmup=0)
