"""The profile measures I, W and B each on its own, and the bytes W holds after I (its stash), and the cost model
charges them as measured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from stagewise.runtime.engine.backward import backward_input, backward_weight
from stagewise.runtime.measure import layer_cost
from stagewise.runtime.measure.layer_cost import held_bytes, reachable_bytes
from stagewise.runtime.measure.profiling import profile

N, WIDTHS = 8, [32, 16, 24, 8]


def _stack() -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(a, b).double() for a, b in zip(WIDTHS, WIDTHS[1:])]


def test_w_holds_each_linear_input_and_output_gradient() -> None:
    """A plain stack of Linear layers, counted by hand: W needs each layer's input (N x d_in) and the gradient at its
    output (N x d_out), float64. Every split design agrees here (the runtime's, which keeps what the boundary nodes
    reach, and one that stashes exactly those tensors), so the profile's figure, the WeightWork's own report and an
    independent walk of what it keeps alive all equal the hand count. (Until the engine's WeightWork reports its
    own bytes, ``held_bytes`` is that walk; once it does, this checks the engine's figure.)"""
    layers = _stack()
    x = torch.randn(N, WIDTHS[0], dtype=torch.float64, requires_grad=True)
    prof = profile(layers, x, repeats=1, warmup=0)
    for layer, a, b in zip(prof.layers, WIDTHS, WIDTHS[1:]):
        assert layer.activation_bytes == 8 * N * a  # the forward saves the input only
        assert layer.weight_activation_bytes == 8 * N * (a + b)
    whole = profile([nn.Sequential(*layers)], x, repeats=1, warmup=0).layers[0]
    want = 8 * N * (sum(WIDTHS[:-1]) + sum(WIDTHS[1:]))
    assert whole.weight_activation_bytes == want
    # the same count straight from the WeightWork (after a-backward's engine lands, held_bytes is its own report)
    out = nn.Sequential(*layers)(x)
    grad = torch.randn_like(out)
    _, work = backward_input([out], [grad], [x])
    resident = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    assert held_bytes(work, resident) == want
    assert reachable_bytes(work, resident) == want
    backward_weight(work)


@dataclass
class _KeepsGraph:
    """Pending weight work that keeps the autograd graph (as a split restarting the engine from a node does)."""

    edges: list[Any]
    grads: list[torch.Tensor]


def test_a_graph_kept_for_w_is_counted_whole() -> None:
    """Work that holds a gradient edge keeps its node and every node behind it alive: the walk counts each tensor
    they saved (parameters excluded), which is what the forward saved, counted independently by a hook, plus the
    gradient the work holds itself."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16)).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    resident = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in resident:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    grad = torch.ones_like(out)
    work = _KeepsGraph([get_gradient_edge(out)], [grad])
    del out
    assert reachable_bytes(work, resident) == sum(saved.values()) + grad.untyped_storage().nbytes()
    assert reachable_bytes(_KeepsGraph([], [grad]), resident) == grad.untyped_storage().nbytes()


def test_i_w_and_b_are_each_timed_from_their_own_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake clock that I, W and B each advance by their own amount, the profile reports exactly those: nothing
    is derived from another (B is not I + W, I + W is not scaled to B), and the cost model charges them so."""
    clock = [0.0]

    def fake_timer(device: torch.device) -> Any:
        def timed(fn: Any) -> tuple[Any, float]:
            start = clock[0]
            out = fn()
            return out, clock[0] - start

        return timed

    def advancing(fn: Any, per_element: float) -> Any:
        def call(roots: Any, *args: Any, **kwargs: Any) -> Any:
            clock[0] += per_element * sum(r.numel() for r in roots)  # the one-element probe call: per_element
            return fn(roots, *args, **kwargs)

        return call

    def weight(work: Any) -> None:
        clock[0] += 5.0
        backward_weight(work)

    monkeypatch.setattr(layer_cost, "timer", fake_timer)
    monkeypatch.setattr(layer_cost, "backward_input", advancing(layer_cost.backward_input, 3.0))
    monkeypatch.setattr(layer_cost, "backward_full", advancing(layer_cost.backward_full, 7.0))
    monkeypatch.setattr(layer_cost, "backward_weight", weight)
    layers = _stack()
    x = torch.randn(N, WIDTHS[0], dtype=torch.float64, requires_grad=True)
    prof = profile(layers, x, repeats=2, warmup=1)
    for layer, b in zip(prof.layers, WIDTHS[1:]):
        elements = N * b - 1  # the layer's output less the one-element call taken off as the runtime's
        assert (layer.backward_input, layer.backward_weight, layer.backward) == (3.0 * elements, 5.0, 7.0 * elements)
    costs = prof.cost_model([0, 1, 3])
    assert costs.backward_input == (3.0 * (N * 16 - 1), 3.0 * (N * 24 - 1 + N * 8 - 1))
    assert costs.backward_weight == (5.0, 10.0)
    assert costs.backward_full == (7.0 * (N * 16 - 1), 7.0 * (N * 24 - 1 + N * 8 - 1))
    stash = [layer.weight_activation_bytes for layer in prof.layers]
    assert costs.weight_activation_bytes == (stash[0], stash[1] + stash[2])


def test_a_value_two_layers_of_a_stage_both_save_is_held_once() -> None:
    """Tanh saves its output and the Linear after it saves the same tensor as its input: profiled layer by layer,
    each counts it, but a stage holding both holds it once. The cost model's stage bytes equal what the memory
    meter counts for the same layers run as one stage; a cut between the two layers keeps both copies."""
    from stagewise.ir import Action, Kind
    from stagewise.runtime.features.memory import ActivationMeter

    torch.manual_seed(0)
    layers = [nn.Linear(32, 64).double(), nn.Tanh(), nn.Linear(64, 8).double()]
    x = torch.randn(N, 32, dtype=torch.float64)
    prof = profile(layers, x, repeats=1, warmup=0)
    tanh, last = prof.layers[1], prof.layers[2]
    assert tanh.output_saved_bytes == last.input_saved_bytes == 8 * N * 64
    at = [Action(0, Kind.F, 0)]
    meter = ActivationMeter([p for m in layers for p in m.parameters()], lambda: at[0])
    with meter.hooks():
        y = nn.Sequential(*layers)(x.requires_grad_())
    assert prof.cost_model([0, 3]).activation_bytes[0] == meter.by_forward[(0, 0)] == 8 * N * (32 + 64)
    del y
    cut = prof.cost_model([0, 2, 3]).activation_bytes
    assert cut == (8 * N * (32 + 64), 8 * N * 64)
