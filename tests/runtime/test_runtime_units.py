"""Runtime pieces in one process: nested values, micro-batching, layer specs, partitions, the I/W split.

Whole pipelines on a one-rank process group are in test_one_rank.py."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime.engine.backward import backward_full, backward_input, backward_weight
from stagewise.runtime.engine.microbatch import batch_size, merge, split
from stagewise.runtime.engine.tree import flatten, leaf_paths, unflatten
from stagewise.runtime.frontends.layers import Chain, named_layers, parameter_count, partition

Pair = namedtuple("Pair", "a b")


# ---- nested values ---------------------------------------------------------------
def test_flatten_round_trips_containers_and_constants() -> None:
    value = {"x": torch.ones(2), "rest": (torch.zeros(1), [3, "s", None]), "p": Pair(torch.ones(1), 2.5)}
    leaves, spec = flatten(value)
    assert len(leaves) == 3
    back = unflatten(spec, leaves)
    assert back["rest"][1] == [3, "s", None] and isinstance(back["p"], Pair) and back["p"].b == 2.5
    assert leaf_paths(spec) == ["output['x']", "output['rest'][0]", "output['p'].a"]


# ---- micro-batches ---------------------------------------------------------------
def test_split_cuts_every_container_and_passes_constants() -> None:
    x = torch.arange(10).reshape(5, 2)
    value = (x, {"t": x.T, "k": "keep"}, [x[:, 0]], 7)
    parts, sizes = split(value, 3, dims=(0, {"t": 1, "k": None}, [0], None))
    assert sizes == [2, 2, 1]
    assert torch.equal(parts[2][0], x[4:]) and torch.equal(parts[0][1]["t"], x.T[:, :2])
    assert parts[1][1]["k"] == "keep" and parts[1][3] == 7
    assert torch.equal(merge([p[0] for p in parts]), x)


def test_split_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="4 micro-batches need at least 4 samples, but the inputs hold a batch of 3"):
        split(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        batch_size((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="no batch dim 2"):
        batch_size(torch.zeros(3, 2), dims=2)
    with pytest.raises(ValueError, match="no batched tensor"):
        batch_size("text")


def test_merge_keeps_structure() -> None:
    pieces = [{"a": torch.ones(2, 3), "n": "x"}, {"a": torch.zeros(1, 3), "n": "x"}]
    merged = merge(pieces)
    assert merged["a"].shape == (3, 3) and merged["n"] == "x"


# ---- layers and partitions ----------------------------------------------------------
def test_layer_specs_are_seeded_by_index_and_leave_the_global_rng_alone() -> None:
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    specs = [sw.Layer(nn.Linear, 4, 4), sw.Layer(nn.Linear, 4, 4)]
    a, b = sw.build_model(specs, seed=3), sw.build_model(specs, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a[0].weight, b[0].weight)
    assert not torch.equal(a[0].weight, a[1].weight)  # seed + index differs per layer
    assert torch.equal(a[1].weight, sw.Layer(nn.Linear, 4, 4).build(seed=4).weight)
    assert [n for n, _ in a.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_named_layers_keep_the_original_names() -> None:
    seq = nn.Sequential()
    seq.add_module("embed", nn.Linear(2, 2))
    seq.add_module("head", nn.Linear(2, 2))
    assert [n for n, _ in named_layers(seq)] == ["embed", "head"]
    with pytest.raises(TypeError, match="not an nn.Module or a stagewise.Layer"):
        named_layers([nn.Linear(2, 2), "oops"])


def test_chain_unpacks_tuples() -> None:
    class Two(nn.Module):
        def forward(self, x):
            return x, x + 1

    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    assert torch.equal(Chain([("0", Two()), ("1", Add())])(torch.ones(1)), torch.full((1,), 3.0))


def test_partitions() -> None:
    named = named_layers(mdl.mlp())
    assert [len(r) for r in partition(named, 4)] == [3, 3, 2, 2]
    assert [len(r) for r in partition(named, 2, [7, 3])] == [7, 3]
    by_params = [len(r) for r in partition(named, 2, "parameters")]
    assert sum(by_params) == 10 and by_params != [5, 5]
    assert parameter_count(sw.Layer(nn.Linear, 1000, 1000)) == 1001000  # built on the meta device
    with pytest.raises(ValueError, match="4 stages need at least 4 layers, got 3"):
        partition(named[:3], 4)
    with pytest.raises(ValueError, match="gives stages \\[1\\] no layers"):
        partition(named, 2, [10, 0])
    with pytest.raises(ValueError, match="must be 'uniform', 'parameters'"):
        partition(named, 2, "balanced")


# ---- the I/W split ---------------------------------------------------------------------
def _graph_nodes(roots: list[torch.Tensor]) -> list:
    seen, stack = [], [r.grad_fn for r in roots if r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.append(node)
        stack += [c for c, _ in node.next_functions if c is not None]
    return seen


def _stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), mdl.Block(8, dtype=torch.float32), nn.Linear(8, 3))


@pytest.mark.parametrize("with_input", [True, False])
def test_input_then_weight_equals_full_backward_and_runs_each_node_once(with_input: bool) -> None:
    stage = _stage()
    x0, g = torch.randn(2, 5, 4), torch.randn(2, 5, 3)

    x = x0.clone().requires_grad_(with_input)
    out = stage(x)
    full_x = backward_full([out], [g], [x] if with_input else [])
    full = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)

    x = x0.clone().requires_grad_(with_input)
    out = stage(x)
    runs: dict = {}
    for node in _graph_nodes([out]):
        node.register_hook(lambda *_, node=node: runs.__setitem__(node, runs.get(node, 0) + 1))
    input_grads, work = backward_input([out], [g], [x] if with_input else [])
    assert all(p.grad is None for p in stage.parameters()), "I made a weight gradient"
    in_i = set(runs)
    backward_weight(work)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, full[name], rtol=1e-6, atol=1e-7)
    if with_input:
        torch.testing.assert_close(input_grads[0], full_x[0])
        assert len(in_i) > 0
    else:
        assert in_i == set(), "with no input to differentiate, I does nothing"
    twice = [type(n).__name__ for n, k in runs.items() if k > 1]
    assert all(k <= 2 for k in runs.values())
    # only the nodes where input and weight paths part (matmuls, norms) run in both I and W
    assert set(twice) <= {"AddmmBackward0", "NativeLayerNormBackward0", "MmBackward0", "BmmBackward0"}, twice


def _mlp(seed: int, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 5, bias=bias), nn.ReLU(), nn.Linear(5, 5, bias=bias), nn.Tanh(), nn.Linear(5, 4, bias=bias)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("bias", [True, False])
def test_plain_linears_accumulate_their_weight_gradient_without_the_engine(bias: bool) -> None:
    """W of 2-D linear layers adds grad.T @ x into .grad itself (no temporary), over several micro-batches, and
    equals the engine's full backward in float64."""
    ref, split, whole = _mlp(3, bias), _mlp(3, bias), _mlp(3, bias)
    xs = [torch.randn(7, 6, dtype=torch.float64) for _ in range(3)]
    gs = [torch.randn(7, 4, dtype=torch.float64) for _ in range(3)]
    for x0, g in zip(xs, gs):  # reference: the engine, micro-batch after micro-batch
        x = x0.clone().requires_grad_()
        ref(x).backward(g)
        x2 = x0.clone().requires_grad_()
        ran: list = []
        out = whole(x2)
        for node in _graph_nodes([out]):
            node.register_hook(lambda *_, node=node, ran=ran: ran.append(node))
        (gx,) = backward_full([out], [g], [x2])  # B: I then the fused W, here
        torch.testing.assert_close(gx, x.grad, rtol=1e-13, atol=1e-14)
        assert not any(type(n).__name__ == "TBackward0" for n in ran), "B made a weight gradient in the engine"
    for (name, p), r in zip(whole.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-13, atol=1e-14, msg=name)
    works, runs = [], {}
    for x0, g in zip(xs, gs):  # all I first, then all W: W accumulates into what the others left
        x = x0.clone().requires_grad_()
        out = split(x)
        for node in _graph_nodes([out]):
            node.register_hook(lambda *_, node=node: runs.__setitem__(node, runs.get(node, 0) + 1))
        works.append(backward_input([out], [g], [x])[1])
    assert all(len(w.linears) == 3 and not w.calls for w in works), "every layer is a plain linear"
    before = dict(runs)
    for work in works:
        backward_weight(work)
    assert runs == before, "W ran the engine"
    for (name, p), r in zip(split.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-13, atol=1e-14, msg=name)


@pytest.mark.parametrize("bias", [True, False])
def test_a_first_stage_of_plain_linears_accumulates_its_weight_gradients_itself(bias: bool) -> None:
    """No input to differentiate (the first stage): I does nothing, W carries the gradient to each linear layer
    and accumulates the layer's weight gradient itself; float64 equal to the engine's over several micro-batches."""
    ref, split, whole = _mlp(5, bias), _mlp(5, bias), _mlp(5, bias)
    works, ran = [], []
    for _ in range(3):
        x, g = torch.randn(7, 6, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
        ref(x).backward(g)
        assert backward_full([whole(x)], [g], []) == []  # B: the same, at once
        out = split(x)
        for node in _graph_nodes([out]):
            node.register_hook(lambda *_, node=node: ran.append(type(node).__name__))
        grads, work = backward_input([out], [g], [])
        assert grads == [] and not ran and len(work.catches) == 1 and not work.calls
        works.append(work)
    for work in works:
        backward_weight(work)
    assert "TBackward0" not in ran and "AccumulateGrad" not in ran, ran
    for (name, p), r, w in zip(split.named_parameters(), ref.parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-13, atol=1e-14, msg=name)
        torch.testing.assert_close(w.grad, r.grad, rtol=1e-13, atol=1e-14, msg=name)


def test_a_first_stage_with_a_weight_used_elsewhere_goes_through_the_engine() -> None:
    lin = nn.Linear(4, 4).double()
    x, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    (lin(x) * lin.weight.sum()).backward(g)
    ref = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    _, work = backward_input([lin(x) * lin.weight.sum()], [g], [])
    assert not work.catches and len(work.calls) == 1
    backward_weight(work)
    torch.testing.assert_close(lin.weight.grad, ref, rtol=1e-13, atol=1e-14)


def test_a_hooked_or_scaled_linear_goes_through_the_engine() -> None:
    """A weight hook must run, so that layer's W is the engine's; addmm with beta != 1 is not a linear layer."""
    stage = _mlp(4)
    seen = []
    stage[2].weight.register_hook(lambda g: seen.append(g.clone()))
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    (gx,), work = backward_input([stage(x)], [torch.ones(3, 4, dtype=torch.float64)], [x])
    assert len(work.linears) == 2 and len(work.calls) == 1
    backward_weight(work)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], stage[2].weight.grad)
    w, b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True), torch.randn(4, dtype=torch.float64)
    b.requires_grad_()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    out = torch.addmm(b, x, w.t(), beta=2.0)
    (gx,), work = backward_input([out], [torch.ones(3, 4, dtype=torch.float64)], [x])
    assert not work.linears
    backward_weight(work)
    torch.testing.assert_close(b.grad, torch.full((4,), 6.0, dtype=torch.float64))


def test_weight_used_twice_falls_back_to_an_exact_restart() -> None:
    lin = nn.Linear(4, 4)
    x0, g = torch.randn(3, 4), torch.randn(3, 4)
    x = x0.clone().requires_grad_()
    (out := lin(torch.tanh(lin(x)))).backward(g)
    ref_w, ref_x = lin.weight.grad.clone(), x.grad.clone()
    lin.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = lin(torch.tanh(lin(x)))
    (gx,), work = backward_input([out], [g], [x])
    assert lin.weight.grad is None
    backward_weight(work)
    torch.testing.assert_close(lin.weight.grad, ref_w)
    torch.testing.assert_close(gx, ref_x)


def test_outputs_that_need_no_gradient_and_scalar_losses() -> None:
    stage = _stage(1)
    x = torch.randn(2, 5, 4, requires_grad=True)
    out = stage(x)
    loss = out.square().mean()
    (gx,), work = backward_input([loss, torch.ones(2)], [None, torch.ones(2)], [x])
    backward_weight(work)
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_()
    stage(x2).square().mean().backward()
    torch.testing.assert_close(gx, x2.grad)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_too_few_samples_per_replica_quotes_the_global_batch_and_the_replicas_share() -> None:
    """dp=2: the user passes a global batch of 4 through local_batch, each replica trains on 2; 4 micro-batches need
    4 samples per replica. The message used to quote only "a batch of 2", which the user never passed."""
    from stagewise.runtime.engine.step import prepare_window

    with pytest.raises(ValueError) as err:
        prepare_window(
            "train", [(torch.zeros(2, 3), torch.zeros(2))], rank=0, placement=[0], num_microbatches=4,
            batch_dims=(0, 0), device=torch.device("cpu"), has_loss=True, replicas=2,
        )  # fmt: skip
    assert str(err.value) == (
        "4 micro-batches need at least 4 samples per data-parallel replica (a global batch of 8 over 2 replicas), "
        "but this replica's inputs hold 2 (a global batch of 4 over 2 replicas)"
    )
    with pytest.raises(ValueError, match="4 micro-batches need at least 4 samples, but the inputs hold a batch of 2$"):
        split(torch.zeros(2, 3), 4)
