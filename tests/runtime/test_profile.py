"""The profiler: per-layer times and bytes that make sense, and a cost model the simulator accepts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.measure.profiling import LayerProfile, model_blocks, profile
from stagewise.simulation import simulate


class Fork(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 2


class Join(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) + b


def test_chain_bytes_are_exact() -> None:
    layers = [nn.Linear(32, 16), nn.ReLU(), Fork(), Join(16)]
    x = torch.randn(8, 32)
    prof = profile(layers, x, repeats=2, warmup=1)
    assert prof.names == ["0", "1", "2", "3"]
    lin, relu, fork, join = prof.layers
    # Linear keeps its input for the weight gradient; the weight itself is not an activation. After I, W holds that
    # input and the layer's output gradient (this layer's input needs none: the first stage's W path)
    assert lin.activation_bytes == 8 * 32 * 4
    assert lin.weight_activation_bytes == 8 * 32 * 4 + 8 * 16 * 4
    assert join.weight_activation_bytes == 2 * 8 * 16 * 4  # its linear's input a, and the gradient at its output
    assert relu.activation_bytes == 8 * 16 * 4 and relu.weight_activation_bytes == 0
    assert lin.parameter_bytes == (32 * 16 + 16) * 4 and relu.parameter_bytes == 0
    assert lin.output_bytes == 8 * 16 * 4 and fork.output_bytes == 2 * 8 * 16 * 4
    assert join.parameter_bytes == (16 * 16 + 16) * 4
    # parameter-free layers have no W (the first layer's I is the runtime's: it makes no input gradient, but carries
    # the output gradient to the layer, as a first stage does)
    assert lin.backward_weight > 0
    assert relu.backward_weight == 0 and relu.backward_input >= 0  # (a ReLU's I may cost no more than the call)
    assert all(layer.forward > 0 and layer.backward >= 0 for layer in prof.layers)


def test_input_and_weight_grads_are_measured_apart() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3)])
    x = torch.randn(64, 256, requires_grad=True)
    prof = profile(layers, x, repeats=5, warmup=2)
    for layer in prof.layers:
        assert layer.forward > 0 and layer.backward_input > 0 and layer.backward_weight > 0
        # W holds the linear's input and its output gradient; the forward saved the input and GELU's input
        assert layer.weight_activation_bytes == layer.activation_bytes == 2 * 64 * 256 * 4


class Net(nn.Module):
    """Registration order differs from call order; BatchNorm and Dropout have side effects to undo."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.body = nn.ModuleList([nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)])
        self.embed = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.body:
            h = layer(h)
        return self.head(torch.relu(h))


def test_model_blocks_in_call_order_without_side_effects() -> None:
    torch.manual_seed(0)
    model = Net()
    assert [n for n, _ in model_blocks(model)] == ["head", "body.0", "body.1", "body.2", "embed"]
    stats = model.body[1].running_mean.clone()
    x = torch.randn(10, 8)
    torch.manual_seed(123)
    prof = profile(model, x, repeats=2, warmup=1)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))  # RNG state untouched
    assert torch.equal(model.body[1].running_mean, stats)  # buffers restored
    assert all(p.grad is None for p in model.parameters())
    assert prof.names == ["embed", "body.0", "body.1", "body.2", "head"]
    assert prof["head"].output_bytes == 10 * 4 * 4
    with pytest.raises(KeyError, match="no layer 'tail'"):
        prof["tail"]


def test_cost_model_sums_stages_and_simulates() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(5)]
    x = torch.randn(16, 64, requires_grad=True)
    prof = profile(layers, x, repeats=3, warmup=1)
    part = prof.partition(2)
    costs = prof.cost_model(part, latency=1e-6, bandwidth=1e10)
    assert costs.num_stages == 2
    for k, (a, b) in enumerate(zip(part.bounds, part.bounds[1:])):
        stage = prof.layers[a:b]
        assert costs.forward[k] == pytest.approx(sum(x.forward for x in stage))
        assert costs.backward(k) == pytest.approx(sum(x.backward for x in stage))  # B as measured
        assert costs.backward_input[k] == pytest.approx(sum(x.backward_input for x in stage))  # not rescaled to B
        assert costs.backward_weight[k] == pytest.approx(sum(x.backward_weight for x in stage))
        assert costs.weight_activation_bytes[k] == sum(x.weight_activation_bytes for x in stage)
        assert costs.parameter_bytes[k] == sum(x.parameter_bytes for x in stage)
        assert costs.activation_bytes[k] == sum(x.activation_bytes for x in stage)
        assert costs.output_bytes[k] == stage[-1].output_bytes
    with pytest.warns(DeprecationWarning, match=r"match_backward=True\) is deprecated"):
        scaled = prof.cost_model([0, 2, 5], match_backward=True)
    for k in range(2):  # the old way: I and W scaled to sum to B
        assert scaled.backward_input[k] + scaled.backward_weight[k] == pytest.approx(scaled.backward(k))
    result = simulate(sw.build_schedule("1f1b", num_ranks=2, num_microbatches=4), costs)
    slowest = max(costs.forward[k] + costs.backward(k) for k in range(2))
    assert result.makespan >= 4 * slowest
    with pytest.raises(ValueError, match="bounds must rise strictly from 0"):
        prof.cost_model([2, 3])
    with pytest.raises(ValueError, match="output_bytes has 1 entries"):
        prof.cost_model([0, 2, 5], output_bytes=[1.0])


def test_lazy_exports() -> None:
    import stagewise.runtime.measure.profiling  # noqa: F401 - importing the module must not shadow sw.profile

    layers = [nn.Linear(4, 4)]
    assert isinstance(sw.profile(layers, torch.randn(2, 4), repeats=1, warmup=0), LayerProfile)
    assert sw.LayerProfile is LayerProfile
    with pytest.raises(ValueError, match="repeats >= 1"):
        profile(layers, torch.randn(2, 4), repeats=0)


def test_the_backward_is_timed_through_the_runtimes_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """B, I and W are the runtime's (a stage's backward accumulates into ``.grad`` and walks the graph, which
    ``autograd.grad`` does not), each run once per timed repeat, W only where there are weights, I and B less the
    same call on a one-node graph (a stage makes one per micro-batch, not one per layer); every parameter's
    ``.grad`` is back as it was, a gradient already there included."""
    from stagewise.runtime.measure import checkpoint_cost, layer_cost, profiling

    calls: dict[str, int] = {}

    def counting(module: object, name: str) -> object:
        real = getattr(module, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return wrapped

    for name in ("backward_full", "backward_input", "backward_weight"):
        monkeypatch.setattr(layer_cost, name, counting(layer_cost, name))
    monkeypatch.setattr(checkpoint_cost, "backward_full", counting(checkpoint_cost, "backward_full"))
    lin = nn.Linear(8, 8)
    lin.weight.grad = torch.full_like(lin.weight, 3.0)
    prof = profile([lin, nn.ReLU()], torch.randn(4, 8, requires_grad=True), repeats=3, warmup=1)
    # 2 layers x 4 runs, I and B each once more on the one-node graph whose time is taken off, B once more on the
    # checkpointed forward's graph; per layer one untimed I and W more, to see what W holds after I (W runs only
    # where there are weights); then the checkpoint's chains (2 lengths, 15 + 2 runs, plain and checkpointed)
    chains = len(profiling.CHAINS) * (15 + 2) * 2
    assert calls == {"backward_input": 16 + 2, "backward_weight": 4 + 2, "backward_full": 2 * 4 * 3 + chains}
    assert torch.equal(lin.weight.grad, torch.full_like(lin.weight, 3.0)) and lin.bias.grad is None
    assert prof.layers[1].backward_weight == 0 and prof.layers[0].backward_weight > 0


class Scale(nn.Module):
    """x * w: autograd saves both factors."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_saved_tensors_are_counted_and_the_checkpoints_line_is_fitted_through_what_was_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """x * w saves 2 tensors (the parameter too: a checkpoint hooks it), ReLU 1 (its output), 3 products 6; each
    layer's checkpoint extras are what the checkpointed forward and backward measured beyond the plain ones, and
    the profile's CheckpointCost is the least-squares line through those and the chains' points; a profile
    written before these fields loads with none."""
    from stagewise.runtime.measure import checkpoint_cost

    chain = nn.Sequential(Scale(), nn.ReLU(), nn.Sequential(Scale(), Scale(), Scale()))
    points: list[list[tuple[float, float, float]]] = []
    real = checkpoint_cost.checkpoint_chains

    def recording(*args: object, **kwargs: object) -> list[tuple[float, float, float]]:
        got = real(*args, **kwargs)  # type: ignore[arg-type]
        points.append(list(got))
        return got

    monkeypatch.setattr(checkpoint_cost, "checkpoint_chains", recording)
    prof = profile(chain, torch.randn(4, 8, requires_grad=True), repeats=3, warmup=1)
    assert [x.saved_tensors for x in prof.layers] == [2.0, 1.0, 6.0]
    assert [n for n, _, _ in points[0]] == [2.0 * k for k in checkpoint_cost.CHAINS]
    xy = points[0] + [(x.saved_tensors, x.checkpoint_forward, x.checkpoint_backward) for x in prof.layers]
    ck = prof.checkpoint
    assert ck is not None
    lines = ((1, ck.segment_forward, ck.per_saved_forward), (2, ck.segment_backward, ck.per_saved_backward))
    for col, fixed, per in lines:  # the least-squares line from the normal equations, as a reference
        n = len(xy)
        sx, sy = sum(p[0] for p in xy), sum(p[col] for p in xy)
        sxx, sxy = sum(p[0] ** 2 for p in xy), sum(p[0] * p[col] for p in xy)
        slope = max(0.0, (n * sxy - sx * sy) / (n * sxx - sx * sx))
        assert per == pytest.approx(slope, rel=1e-9, abs=1e-15)
        assert fixed == pytest.approx(max(0.0, (sy - slope * sx) / n), rel=1e-9, abs=1e-15)
    want = (ck.segment_forward + 10 * ck.per_saved_forward, ck.segment_backward + 10 * ck.per_saved_backward)
    assert ck.stage(10.0) == pytest.approx(want, rel=1e-12)
    again = LayerProfile.from_json(prof.to_json())
    assert again == prof
    old = json.loads(prof.to_json())
    del old["checkpoint"]
    for layer in old["layers"]:
        for field in ("saved_tensors", "checkpoint_forward", "checkpoint_backward"):
            del layer[field]
    legacy = LayerProfile.from_json(json.dumps(old))
    assert legacy.checkpoint is None and [x.saved_tensors for x in legacy.layers] == [0.0, 0.0, 0.0]


class Shrinking(nn.Module):
    """Saves one tensor fewer on every call: torch's checkpoint refuses to re-run it (its recompute differs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for _ in range(max(1, 60 - self.calls)):
            x = x * x
        return x


def test_a_layer_the_checkpoint_cannot_re_run_is_profiled_without_its_checkpoint_cost() -> None:
    """Profiling does not fail on a layer that recompute could not run: its checkpoint extras are 0, the others'
    are measured, and its own times are."""
    prof = profile([nn.Linear(8, 8), Shrinking()], torch.randn(4, 8, requires_grad=True), repeats=3, warmup=1)
    lin, shrinking = prof.layers
    assert shrinking.checkpoint_forward == 0.0 and shrinking.checkpoint_backward == 0.0
    assert shrinking.forward > 0 and shrinking.saved_tensors >= 2 and not math.isnan(lin.checkpoint_forward)
    assert prof.checkpoint is not None


def test_rounds_keep_each_layers_fastest_round_and_fit_the_checkpoint_line_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``profile(rounds=3)`` measures three times; each layer keeps the round where its F + B was least (a burst of
    other work only ever slows a round), and the checkpoint line is fitted once, on what was kept."""
    from dataclasses import replace

    from stagewise.partition import LayerCost
    from stagewise.runtime.measure import profiling

    def one(f0: float, f1: float) -> LayerProfile:
        cost = LayerCost("x", 0.0, 0.0, 0.0, 0.0, 8.0, 4.0, 16.0, 8.0)
        return LayerProfile(
            (replace(cost, name="a", forward=f0, backward=f0), replace(cost, name="b", forward=f1)), "cpu", 1, 0
        )

    rounds = iter([one(3.0, 1.0), one(1.0, 5.0), one(2.0, 2.0)])
    fitted: list[LayerProfile] = []
    monkeypatch.setattr(profiling, "measure_layers", lambda *args, **kwargs: next(rounds))
    monkeypatch.setattr(profiling, "with_checkpoint_cost", lambda p: fitted.append(p) or p)
    got = profiling.profile(nn.Linear(2, 2), torch.zeros(1, 2), rounds=3)
    assert [(c.name, c.forward, c.backward) for c in got.layers] == [("a", 1.0, 1.0), ("b", 1.0, 0.0)]
    assert fitted == [got] and next(rounds, None) is None
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"rounds must be an int >= 1, got {bad!r}"):
            profile(nn.Linear(2, 2), torch.zeros(1, 2), rounds=bad)  # type: ignore[arg-type]


def test_a_tied_later_use_saves_no_activation_for_the_shared_matrix() -> None:
    """A GPT-style head on the embedding's matrix (``sw.Tied``'s later use registers no parameter): matmul saves
    its input (4 x 5 x 8 float32) and the matrix, a parameter the runtime's meter leaves out, so must the profile
    (it counted the 16 x 8 matrix once per micro-batch: the calibration benchmark's last rank over by 512 KiB a
    micro-batch on gpt256)."""
    layers = [sw.Tied("tok", nn.Embedding(16, 8)), nn.Linear(8, 8), sw.Tied("tok", forward_fn=_logits)]
    prof = profile(sw.build_model(layers, seed=0), torch.randint(0, 16, (4, 5)), repeats=1, warmup=0)
    assert prof.layers[2].parameter_bytes == 0  # the matrix is the first use's
    assert prof.layers[2].activation_bytes == 4 * 5 * 8 * 4


def _logits(tokens: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ tokens.weight.t()
