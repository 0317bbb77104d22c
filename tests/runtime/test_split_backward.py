"""The split backward (runtime/engine/backward.py): I then W does exactly B's work, once, and between them only
W's stash is alive - linear layers (3-D inputs, Conv1D, the tied head), convolutions, recompute, autocast."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from stagewise.ir import Action, Kind
from stagewise.runtime.engine.backward import WeightWork, backward_full, backward_input, backward_weight
from stagewise.runtime.engine.compute import Compute
from stagewise.runtime.engine.run import Run, RunRecord, Saved
from stagewise.runtime.features.memory import ActivationMeter
from stagewise.runtime.features.recompute import run_layers


class Conv1D(nn.Module):
    """transformers' Conv1D: ``addmm(b, x, w)``, the weight not transposed."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Attention(nn.Module):
    """A pre-norm block: fused QKV, attention, projection and an MLP (3-D inputs, views, residuals)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(x)


class TiedHead(nn.Module):
    """The tied LM head: ``F.linear(h, wte.weight)`` (no bias; an ``mm`` behind a transpose)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.wte.weight) * 0.5


class Counting(nn.Module):
    """Counts its forwards (the first recomputed op of a segment)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 1.0


# model -> (layers, input shape, names of the parameters W owns: weights; biases are made in I)
MODELS: dict[str, tuple[Callable[[], list[nn.Module]], tuple[int, ...], set[str]]] = {
    "mlp": (
        lambda: [nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 6, bias=False), nn.Tanh(), nn.Linear(6, 8)],
        (3, 5, 8),
        {"0.weight", "2.weight", "4.weight"},
    ),
    "block": (
        lambda: [Attention(8), Attention(8)],
        (2, 5, 8),
        {f"{b}.{n}.weight" for b in "01" for n in ("qkv", "proj", "mlp.1", "mlp.3")},
    ),
    "conv1d": (
        lambda: [Conv1D(8, 6), nn.GELU(), nn.LayerNorm(6), Conv1D(6, 8)],
        (2, 5, 8),
        {"0.weight", "3.weight"},
    ),
    "tied-head": (
        lambda: [nn.Linear(8, 8), nn.LayerNorm(8), TiedHead(8)],
        (2, 5, 8),
        {"0.weight", "2.wte.weight"},
    ),
    "conv": (
        lambda: (
            [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten()]
            + [nn.Linear(64, 5)]
        ),
        (2, 3, 6, 6),
        {"0.weight", "3.weight", "5.weight"},
    ),
}


def _build(name: str, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(*MODELS[name][0]()).to(dtype)


def _data(name: str, k: int, with_input: bool, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    torch.manual_seed(100 + k)
    return [torch.randn(*MODELS[name][1], dtype=dtype).requires_grad_(with_input) for _ in range(3)]


def _out_grad(y: torch.Tensor) -> torch.Tensor:
    return 0.1 + 0.01 * y.detach()


def _engine(model: nn.Sequential, xs: list[torch.Tensor], autocast: bool = False) -> list[torch.Tensor | None]:
    """The reference: the engine's backward, micro-batch after micro-batch; the input gradients."""
    out = []
    for x0 in xs:
        x = x0.detach().clone().requires_grad_(x0.requires_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
        y.backward(_out_grad(y))
        out.append(x.grad)
    return out


def _assert_grads(model: nn.Module, ref: nn.Module, rtol: float = 1e-12, atol: float = 1e-14) -> None:
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("with_input", [True, False], ids=["inner-stage", "first-stage"])
@pytest.mark.parametrize("name", list(MODELS))
def test_i_then_w_is_the_engines_backward_and_i_makes_no_deferred_gradient(name: str, with_input: bool) -> None:
    """Three micro-batches: every I, then every W (W accumulates into what the other Ws left), and B as I then W
    at once, against the engine in float64. I makes every gradient but the deferred ones, which it leaves None."""
    ref, split, whole = _build(name), _build(name), _build(name)
    xs = _data(name, 0, with_input)
    want = _engine(ref, xs)
    works: list[WeightWork] = []
    for k, x0 in enumerate(xs):
        x = x0.detach().clone().requires_grad_(with_input)
        y = split(x)
        got, work = backward_input([y], [_out_grad(y)], [x] if with_input else [])
        works.append(work)
        if with_input:
            torch.testing.assert_close(got[0], want[k], rtol=1e-12, atol=1e-14)
            assert x.grad is None, "I leaves the input's .grad as it was"
        if k == 0:
            made = {n for n, p in split.named_parameters() if p.grad is not None}
            assert made == {n for n, _ in split.named_parameters()} - MODELS[name][2], "I made a deferred gradient"
        y2 = whole(x0.detach().clone().requires_grad_(with_input))
        backward_full([y2], [_out_grad(y2)], [])
    for work in works:
        backward_weight(work)
    _assert_grads(split, ref)
    _assert_grads(whole, ref)


@pytest.mark.parametrize("recompute", ["stage", 2])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp64", "bf16-autocast"])
def test_a_recomputed_stage_runs_its_forward_once_more_in_i_and_never_in_w(recompute: object, autocast: bool) -> None:
    """Checkpointed segments (as ``recompute=`` runs them): I recomputes each segment once, takes the deferred
    ops' inputs from that recompute, and W runs no forward; gradients equal the unrecomputed engine's (under
    bf16 autocast: W computes in the op's dtype, then casts, as the engine does)."""
    dtype = torch.float32 if autocast else torch.float64
    torch.manual_seed(2)
    layers = [Counting(), *MODELS["block"][0](), Counting(), Conv1D(8, 8)]
    split = nn.Sequential(*layers).to(dtype)
    ref = copy.deepcopy(split)
    xs = _data("block", 1, True, dtype)
    want = _engine(ref, xs, autocast)
    counters = [m for m in split if isinstance(m, Counting)]
    works = []
    for k, x0 in enumerate(xs):
        x = x0.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = run_layers(list(split), x, recompute)  # type: ignore[arg-type]
        assert [c.calls for c in counters] == [2 * k + 1] * 2
        (gx,), work = backward_input([y], [_out_grad(y)], [x], checkpointed=list(split.parameters()))
        assert [c.calls for c in counters] == [2 * k + 2] * 2, "I recomputes each segment once"
        assert len(work) == 9 and work.held_bytes() > 0
        torch.testing.assert_close(gx, want[k], rtol=1e-12 if not autocast else 1e-5, atol=1e-14)
        works.append(work)
    for work in works:
        backward_weight(work)
    assert [c.calls for c in counters] == [6, 6], "W re-ran a forward"
    _assert_grads(split, ref, *((1e-12, 1e-14) if not autocast else (1e-5, 1e-6)))


def _metered(params: list[nn.Parameter]) -> tuple[ActivationMeter, list[Action | None]]:
    at: list[Action | None] = [None]
    return ActivationMeter(params, lambda: at[0]), at


def test_i_frees_the_graph_and_w_holds_the_linear_inputs_and_output_gradients() -> None:
    """After I nothing the forward saved is alive but W's stash: the inputs of the linear layers (which the
    forward saved too) and their output gradients, each storage once - the paper's M_W. W frees it."""
    model = _build("mlp")
    meter, at = _metered(list(model.parameters()))
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    with meter.hooks():
        at[0] = Action(0, Kind.F, 0)
        y = model(x)
        at[0] = None
    assert meter.current == meter.by_forward[(0, 0)] > 0
    (gx,), work = backward_input([y], [_out_grad(y)], [x])
    del y
    assert meter.current == 0, "a node of the graph still holds what the forward saved"
    rows = 15
    linears = [m for m in model if isinstance(m, nn.Linear)]
    want = sum(rows * (m.in_features + m.out_features) * 8 for m in linears)
    assert work.held_bytes() == want, (work.held_bytes(), want)
    backward_weight(work)
    assert work.held_bytes() == 0 and len(work) == 0


def test_w_twice_and_w_before_i_are_refused_by_name() -> None:
    model = _build("mlp")
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y = model(x)
    _, work = backward_input([y], [_out_grad(y)], [])
    backward_weight(work)
    with pytest.raises(RuntimeError, match="W ran twice"):
        backward_weight(work)
    handlers = Compute({}, None, last=1)  # the handlers alone: W with no I before it
    run = Run("train", RunRecord("train", None, None, None))
    run.saved = {(1, 3): Saved([], [y])}
    with pytest.raises(RuntimeError, match="1W3: W of stage 1 micro-batch 3 before its I"):
        handlers.backward_weight(run, Action(1, Kind.W, 3))
    with pytest.raises(RuntimeError, match="before its I"):
        handlers.backward_weight(run, Action(0, Kind.W, 0))


def test_a_weight_used_twice_hooked_or_scaled_stays_in_i() -> None:
    """Deferred only where W can make the gradient alone: a weight used by two layers, one with a hook (which
    must run, once), ``addmm`` with beta != 1, and a stage input used as a weight get their gradients in I."""
    torch.manual_seed(3)
    lin, other = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    seen: list[torch.Tensor] = []
    other.weight.register_hook(lambda g: seen.append(g.clone()))
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(b, other(torch.tanh(lin(lin(x)))), lin.weight.t(), beta=2.0)

    x0, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    run(x).backward(g)
    ref = [p.grad.clone() for p in (lin.weight, lin.bias, other.weight, other.bias, b)]
    for p in (lin.weight, lin.bias, other.weight, other.bias, b):
        p.grad = None
    x = x0.clone().requires_grad_()
    (gx,), work = backward_input([run(x)], [g], [x])
    assert len(work) == 0 and len(seen) == 2
    torch.testing.assert_close(seen[1], other.weight.grad)
    backward_weight(work)
    for p, r in zip((lin.weight, lin.bias, other.weight, other.bias, b), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-13, atol=1e-14)
    w_in = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)  # a weight sent by the previous stage
    (gw, gx), work = backward_input([F.linear(x, w_in)], [g[:, :1].expand(3, 4)], [w_in, x])
    assert len(work) == 0 and gw is not None and w_in.grad is None
    torch.testing.assert_close(gw, g[:, :1].expand(3, 4).t() @ x, rtol=1e-13, atol=1e-14)


def test_other_checkpoints_stay_in_i_and_listed_weights_outside_one_are_read_in_i() -> None:
    """An op inside torch's own checkpoint (the profiler's, say: its recompute hands nothing over) keeps its
    weight gradient in I, which recomputes once; a weight listed as a recomputed stage's but used outside its
    segments (in the loss) is deferred and read as usual; listed inside a foreign checkpoint, a clear error."""
    torch.manual_seed(4)
    lin, head = nn.Linear(4, 4).double(), nn.Linear(4, 2).double()
    counter = Counting()
    x0, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    head(lin(x)).backward(g)
    ref = [p.grad.clone() for p in (lin.weight, lin.bias, head.weight, head.bias)]
    for p in (lin.weight, lin.bias, head.weight, head.bias):
        p.grad = None
    x = x0.clone().requires_grad_()
    y = head(checkpoint(lambda t: lin(counter(t)), x, use_reentrant=False))
    (gx,), work = backward_input([y], [g], [x], checkpointed=[head.weight, head.bias])
    assert counter.calls == 2 and lin.weight.grad is not None and head.weight.grad is None and len(work) == 1
    backward_weight(work)
    for p, r in zip((lin.weight, lin.bias, head.weight, head.bias), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-13, atol=1e-14)
    y = head(checkpoint(lin, x0.clone().requires_grad_(), use_reentrant=False))
    with pytest.raises(RuntimeError, match=r"no recomputed input for the AddmmBackward0 of a weight of shape \(4, 4\)"):
        backward_input([y], [g], [], checkpointed=[lin.weight])


def _nodes(root: torch.Tensor) -> list:
    seen, stack = [], [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.append(node)
            stack += [c for c, _ in node.next_functions]
    return seen


def test_every_node_runs_once_in_i_and_w_runs_none() -> None:
    model = _build("block")
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    y = model(x)
    runs: dict = {}
    for node in _nodes(y):
        node.register_hook(lambda *_, node=node: runs.__setitem__(node, runs.get(node, 0) + 1))
    _, work = backward_input([y], [_out_grad(y)], [x])
    assert runs and max(runs.values()) == 1
    names = {type(n).__name__ for n in runs}
    assert "AddmmBackward0" in names and "TBackward0" not in names, "I ran a deferred weight's branch"
    before = dict(runs)
    backward_weight(work)
    assert runs == before, "W ran the engine"


def test_outputs_that_need_no_gradient_and_scalar_losses() -> None:
    """Roots as the last stage gives them (the loss, with no output gradient) beside outputs needing none."""
    model = _build("block")
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    loss = model(x).square().mean()
    (gx,), work = backward_input([loss, torch.ones(2)], [None, torch.ones(2)], [x])
    backward_weight(work)
    ref = _build("block")
    x2 = x.detach().clone().requires_grad_()
    ref(x2).square().mean().backward()
    torch.testing.assert_close(gx, x2.grad, rtol=1e-12, atol=1e-14)
    _assert_grads(model, ref)


def test_tensor_parallel_linears_split_too_and_match_the_engine() -> None:
    """Column- and row-parallel linears (DTensor weights) on torch's fake process group (rank 0 of 2): W's
    ``mm`` goes through DTensor's dispatch as the engine's does; the gradients' local shards and placements
    equal the engine's (the fake collectives return what they are given: the same on both paths)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def build() -> nn.Module:
            model = _build("mlp")[:3]  # Linear(8, 6), ReLU, Linear(6, 6)
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            return model

        ref, split = build(), build()
        x0, g = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
        x = x0.clone().requires_grad_()
        ref_out = ref(x)
        ref_out.backward(g)
        x2 = x0.clone().requires_grad_()
        out = split(x2)
        (gx,), work = backward_input([out], [g], [x2])
        assert len(work) == 2 and all(isinstance(item.g, DTensor) for item in work.stash) and work.held_bytes() > 0
        backward_weight(work)
        torch.testing.assert_close(gx, x.grad, rtol=1e-13, atol=1e-14)
        for (name, p), r in zip(split.named_parameters(), ref.parameters()):
            assert p.grad.placements == r.grad.placements, name
            torch.testing.assert_close(p.grad.to_local(), r.grad.to_local(), rtol=1e-13, atol=1e-14)
        # The row-parallel output is an AsyncCollectiveTensor (its all-reduce in flight until first read); here it
        # is only differentiated, never read, so its collective stays registered as unwaited and torch prints
        # "there are still 2 unwaited collective calls" (c10d_functional) when the process ends. Read them.
        for act in (ref_out, out):
            act.wait()
        assert torch._C._distributed_c10d._get_work_registry_size() == 0
    finally:
        dist.destroy_process_group()


def test_the_meter_counts_each_saved_byte_once_however_many_views_hold_it() -> None:
    """A tensor saved as it is and again reshaped (tanh saves its output; the matmul after it saves a 2-D view of
    it, as attention's output is saved by SDPA and by the projection in a GPT block) counts once; a slice of a
    batch counts the bytes it spans, not the batch's; all of it is free once the graph is."""
    w = nn.Parameter(torch.randn(8, 4, dtype=torch.float64))
    meter, at = _metered([w])
    x = torch.randn(6, 3, 8, dtype=torch.float64, requires_grad=True)
    with meter.hooks():
        at[0] = Action(0, Kind.F, 0)
        h = torch.tanh(x[:2])  # saves h (2 x 3 x 8)
        y = h.reshape(6, 8) @ w  # saves h's 2-D view (the same bytes) and w (a parameter: not counted)
        at[0] = None
    assert meter.by_forward[(0, 0)] == meter.current == meter.peak == 2 * 3 * 8 * 8
    y.sum().backward()
    del y, h
    assert meter.current == 0
