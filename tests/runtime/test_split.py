"""split_model: tagged and untagged models cut into stages that, chained, equal the model exactly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.frontends.split import SplitError, collect_tags, split_model, stage
from stagewise.runtime.measure.profiling import profile

# --- models ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Returns a dict, so the graph has dict intermediates."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.lin(x))
        return {"h": h, "n": self.norm(h)}


class TaggedNet(nn.Module):
    """Arbitrary forward: dict and tuple intermediates, a Python constant, an int from x.size(0) that crosses
    two cuts, a residual from stage 0 used on stage 2, a model input used only by the last stage, and a bare
    parameter (``gate``)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.a = Block(d)
        self.b = Block(d)
        self.c = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.scale = 0.5

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        out = self.a(e)
        pair = (out["h"], out["n"] * self.scale)
        hb = self.b(pair[0] + pair[1])["n"]
        hc = self.c(hb) * self.gate + e
        n = x.size(0)
        return self.head(hc).sum(-1) / n + y


def tagged_net() -> TaggedNet:
    torch.manual_seed(0)
    model = TaggedNet()
    for name, k in {"embed": 0, "a": 0, "b": 1, "c": 2, "head": 2}.items():
        model.get_submodule(name).pipeline_stage = k
    return model


class GuardedNet(nn.Module):
    """Tagged while built, Paddle device_guard style, with a nested block and a ModuleList spanning stages."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        with stage(0):
            self.inp = nn.Linear(4, d)
            self.blocks = nn.ModuleList([Block(d)])
        with stage(1):
            self.blocks.append(Block(d))
            with stage(2):
                self.out = nn.Linear(d, d)
            self.mid = nn.Linear(d, d)
        self.pos = nn.Parameter(torch.linspace(-1, 1, d))  # untagged, used only on stage 2

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        skip = h
        for blk in self.blocks:
            h = blk(h)["h"]
        h = self.mid(h)
        bias = self.pos * 2  # parameters only: floats to its first user's stage
        return (self.out(h) + skip) * bias, h.mean()


def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return sum(((i + 1) * o.pow(2).sum() for i, o in enumerate(out)), torch.zeros(()))
    return out.pow(2).sum()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pipelined_step(split: sw.runtime.SplitModel, inputs: tuple[Any, ...]) -> Any:
    """Run the stages as a pipeline would: values cross each cut as fresh leaves; gradients travel back."""
    received: list[tuple[Any, ...]] = []
    sent: list[tuple[Any, ...]] = []
    values: Any = inputs
    for k, module in enumerate(split.stage_modules):
        values = tuple(
            v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and k > 0 else v for v in values
        )
        received.append(values)
        values = module(*values)
        sent.append(values)
    out = values
    _loss(out).backward()
    for k in range(split.num_stages - 2, -1, -1):
        pairs = [
            (o, r.grad)
            for o, r in zip(sent[k], received[k + 1])
            if isinstance(r, torch.Tensor) and r.requires_grad and r.grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return out


def _plain_step(split: sw.runtime.SplitModel, inputs: tuple[Any, ...]) -> Any:
    out = split.run(*inputs)
    _loss(out).backward()
    return out


def _assert_parity(model: nn.Module, inputs: tuple[Any, ...], split: sw.runtime.SplitModel) -> None:
    """Chained stages give the model's output exactly and its gradients to float rounding."""
    model.zero_grad()
    expected = model(*inputs)
    _loss(expected).backward()
    expected_grads = _grads(model)
    for step in (_plain_step, _pipelined_step):
        model.zero_grad()
        got = step(split, inputs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        got_grads = _grads(model)
        assert got_grads.keys() == expected_grads.keys()
        for name in expected_grads:
            torch.testing.assert_close(got_grads[name], expected_grads[name], rtol=1e-6, atol=1e-7, msg=name)


# --- tags ------------------------------------------------------------------------------------


def test_stage_context_tags_modules_and_restores_init() -> None:
    init = nn.Module.__init__
    model = GuardedNet()
    assert nn.Module.__init__ is init
    assert collect_tags(model) == {
        "inp": 0,
        "blocks": 0,
        "blocks.0": 0,
        "blocks.0.lin": 0,
        "blocks.0.norm": 0,
        "blocks.1": 1,
        "blocks.1.lin": 1,
        "blocks.1.norm": 1,
        "out": 2,
        "mid": 1,
    }
    assert not hasattr(nn.Linear(2, 2), "pipeline_stage")
    with pytest.raises(RuntimeError), stage(3):
        raise RuntimeError("boom")
    assert nn.Module.__init__ is init
    with pytest.raises(ValueError, match="int >= 0"), stage(-1):
        pass
    assert sw.stage is stage


def test_tagged_model_splits_with_skips_and_equals_original() -> None:
    model = tagged_net()
    inputs = (torch.randn(5, 4), torch.randn(5))
    split = split_model(model, inputs)
    assert split.num_stages == 3
    # stage 1 forwards the residual `embed`, the input `y` and the int `size` it does not use itself
    assert split.stage_inputs[1] == ("y", "embed", "add", "size")
    assert split.stage_inputs[2] == ("y", "embed", "getitem_2", "size")
    assert split.boundaries is not None
    by_name = {v.name: v for v in split.boundaries[1]}
    assert by_name["embed"].made_on == 0 and by_name["embed"].kind == "tensor" and by_name["embed"].requires_grad
    assert by_name["y"].made_on == -1 and not by_name["y"].requires_grad
    assert by_name["size"].kind == "int"
    assert split.boundary_bytes() == [4 * 5 + 2 * 4 * 5 * 8, 4 * 5 + 2 * 4 * 5 * 8, 0.0]
    _assert_parity(model, inputs, split)


def test_guarded_model_splits_and_equals_original() -> None:
    torch.manual_seed(1)
    model = GuardedNet()
    inputs = (torch.randn(6, 4),)
    split = split_model(model, inputs)
    assert split.num_stages == 3
    assert "skip" not in split.stage_inputs[1]  # node names come from the graph: the residual is `inp`
    assert "inp" in split.stage_inputs[1] and "inp" in split.stage_inputs[2]
    assert split.parameter_stages()["pos"] == 2  # floated to where it is used
    _assert_parity(model, inputs, split)


class Modal(nn.Module):
    """A forward with Python-valued arguments: a branch on a string and a float scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.a.pipeline_stage = 0
        self.b.pipeline_stage = 1

    def forward(self, x: torch.Tensor, mode: str = "relu", scale: float = 1.0) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h) if mode == "tanh" else torch.relu(h)) * scale


def test_concrete_args_are_the_values_the_stages_run_with() -> None:
    """``concrete_args`` fixes Python-valued arguments: the stages, given the inputs alone (as a pipeline gives
    them), run as the model does with those values. fx kept the forward's own defaults and asserted each value
    passed equalled the fixed one, so the first step failed ("mode has been specialized to have value tanh")."""
    torch.manual_seed(0)
    model, x = Modal(), torch.randn(5, 4)
    split = split_model(model, (x,), concrete_args={"mode": "tanh", "scale": 2.0})
    assert split.num_stages == 2
    model.zero_grad()
    expected = model(x, "tanh", 2.0)
    _loss(expected).backward()
    want = _grads(model)
    for step in (_plain_step, _pipelined_step):
        model.zero_grad()
        torch.testing.assert_close(step(split, (x,)), expected, rtol=0, atol=0)
        for name, g in _grads(model).items():
            torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_parameter_names_map_back_to_the_model() -> None:
    model = tagged_net()
    split = split_model(model, (torch.randn(5, 4), torch.randn(5)))
    owners = split.parameter_stages()
    assert set(owners) == {n for n, _ in model.named_parameters()}
    assert owners["a.norm.weight"] == 0 and owners["b.lin.bias"] == 1 and owners["gate"] == 2
    full = model.state_dict()
    for k, module in enumerate(split.stage_modules):
        for name, tensor in module.state_dict().items():
            assert tensor is full[name] or torch.equal(tensor, full[name])
        for name, p in split.named_parameters(k):
            assert p is model.get_parameter(name)  # shared, not copied


def test_backward_tags_name_the_modules() -> None:
    model = tagged_net()
    model.head.pipeline_stage = 1  # head reads c's output, which is on stage 2
    with pytest.raises(SplitError, match="go backwards") as err:
        split_model(model)
    assert "'head'" in str(err.value) and "'c'" in str(err.value)


def test_module_reused_across_stages_is_named() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.b(self.a(x)))

    model = Reuse()
    model.a.pipeline_stage, model.b.pipeline_stage = 0, 1
    with pytest.raises(SplitError, match="'a' is called 2 times"):
        split_model(model)
    with pytest.raises(SplitError, match="placed by the partition on stage 0"):
        split_model(Reuse(), stages=2)


def test_tied_parameters_across_stages_are_reported() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.embed(ids)))

    model = Tied()
    model.embed.pipeline_stage, model.mid.pipeline_stage, model.head.pipeline_stage = 0, 1, 1
    split = split_model(model)
    assert split.tied == {"embed.weight": (0, 1)}  # one parameter, its first name; the Pipeline sums its gradients
    ids = torch.arange(10).reshape(2, 5)
    torch.testing.assert_close(split.run(ids), model(ids))
    assert split_model(Tied(), stages=2).tied == {"embed.weight": (0, 1)}  # untagged: any cut separates them
    model.head.pipeline_stage = 0
    model.mid.pipeline_stage = 0
    model.embed.pipeline_stage = 0
    assert split_model(model).tied == {}  # both users on one stage: nothing to sum


def test_tag_errors_are_clear() -> None:
    model = tagged_net()
    with pytest.raises(SplitError, match="partition= and costs= do not apply"):
        split_model(model, partition="time")
    with pytest.raises(SplitError, match=r"stage\(s\) \[3\] of 4 would compute nothing"):
        split_model(model, stages=4)
    with pytest.raises(SplitError, match=r"2 stages asked for"):
        split_model(model, stages=2)
    with pytest.raises(SplitError, match="no pipeline_stage tags"):
        split_model(nn.Sequential(nn.Linear(2, 2)))


def test_untraceable_code_is_reported_and_a_tag_makes_it_a_leaf() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) if x.sum() > 0 else -x  # data-dependent: fx cannot trace through it

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.branchy = Branchy()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.branchy(self.first(x))

    model = Outer()
    model.first.pipeline_stage = 0
    model.branchy.lin.pipeline_stage = 1
    with pytest.raises(SplitError, match="could not trace Outer"):
        split_model(model)
    del model.branchy.lin.pipeline_stage
    model.branchy.pipeline_stage = 1
    x = torch.randn(3, 4)
    split = split_model(model, x)
    torch.testing.assert_close(split.run(x), model(x), rtol=0, atol=0)


# --- untagged models: cut among top-level blocks -------------------------------------------


class Tower(nn.Module):
    """embed, layers.0..n-1 (MLPs of the given hidden widths), head; forward with a residual per layer."""

    def __init__(self, hidden: list[int], d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for h in hidden)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_untagged_uniform_parameters_and_counts() -> None:
    torch.manual_seed(2)
    model = Tower([8, 8, 8, 64, 64, 8])
    x = torch.randn(8, 16)
    blocks = ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "head")
    uniform = split_model(model, x, stages=3)
    assert uniform.blocks == blocks
    assert uniform.block_partition is not None and uniform.block_partition.counts == [3, 3, 2]
    assert uniform.module_stages["layers.2"] == 1 and uniform.module_stages["head"] == 2
    _assert_parity(model, (x,), uniform)
    by_params = split_model(model, x, stages=3, partition="parameters")
    assert by_params.block_partition is not None
    assert by_params.block_partition.bottleneck < max(
        sum(p.numel() for b in blocks[a:z] for p in model.get_submodule(b).parameters())
        for a, z in [(0, 3), (3, 6), (6, 8)]
    )
    _assert_parity(model, (x,), by_params)
    counted = split_model(model, x, stages=2, partition=[5, 3])
    assert counted.module_stages["layers.3"] == 0 and counted.module_stages["layers.4"] == 1
    with pytest.raises(SplitError, match=r"partition \[5, 2\] sums to 7 blocks, but the model has 8"):
        split_model(model, x, stages=2, partition=[5, 2])
    with pytest.raises(SplitError, match="need at least 9 top-level blocks"):
        split_model(model, x, stages=9)
    with pytest.raises(SplitError, match="pass example_inputs"):
        split_model(model, stages=2, partition="time")


def test_time_partition_balances_an_unbalanced_model() -> None:
    torch.manual_seed(3)
    model = Tower([8, 8, 2048, 2048, 8, 8, 8, 8])  # two adjacent layers ~50x the others
    x = torch.randn(64, 16)
    timed = split_model(model, x, stages=4, partition="time")
    uniform = split_model(model, x, stages=4, partition="uniform")
    assert timed.profile is not None and timed.profile.names == list(timed.blocks)
    assert timed.block_partition is not None and uniform.block_partition is not None
    # uniform ([3, 3, 2, 2] of 10 blocks) puts the two big layers on one stage; time gives them one each
    assert uniform.module_stages["layers.2"] == uniform.module_stages["layers.3"]
    assert timed.module_stages["layers.2"] != timed.module_stages["layers.3"]
    # predicted from the block profile (the DP is optimal for these costs, so never worse than uniform) ...
    costs = timed.profile.times()
    predicted = [
        max(sum(costs[a:b]) for a, b in zip(p.bounds, p.bounds[1:]))
        for p in (timed.block_partition, uniform.block_partition)
    ]
    assert predicted[0] <= predicted[1]  # (measured stage times belong in a benchmark: this CPU is shared)
    _assert_parity(model, (x,), timed)


def test_time_partition_from_given_costs() -> None:
    model = Tower([8, 8, 8, 8])
    split = split_model(model, stages=2, costs=[1, 1, 1, 1, 10, 1])
    assert split.block_partition is not None and split.block_partition.counts == [4, 2]
    with pytest.raises(SplitError, match="costs has 3 entries"):
        split_model(model, stages=2, costs=[1, 2, 3])


def test_split_model_profile_gives_a_cost_model_that_simulates() -> None:
    from stagewise.simulation import simulate

    model = tagged_net()
    inputs = (torch.randn(5, 4), torch.randn(5))
    split = split_model(model, inputs)
    prof = profile(list(split.stage_modules), inputs, repeats=3, warmup=1)
    costs = prof.cost_model([0, 1, 2, 3], output_bytes=split.boundary_bytes())
    assert costs.num_stages == 3 and costs.output_bytes == tuple(split.boundary_bytes())
    result = simulate(sw.build_schedule("1f1b", num_ranks=3, num_microbatches=4), costs)
    assert result.makespan > 0
