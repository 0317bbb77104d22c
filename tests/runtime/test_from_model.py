"""Profile-based partitions of a pipeline and ``Pipeline.from_model`` on a one-rank process group.

The partition modes on their own (pure) are in tests/core/test_partition.py; the multi-process checks (2 and 4
ranks) in tests/distributed/workers/from_model_checks.py; the models in helpers/nets.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_grads_close
from helpers.nets import SkipNet, skip_data
from helpers.profiles import fake_profile
from stagewise.runtime.frontends.balance import in_flight, per_stage, profile_layers
from stagewise.runtime.frontends.layers import named_layers, partition
from stagewise.runtime.measure.profiling import steadiest


def test_per_rank_options_become_per_stage() -> None:
    v = sw.build_schedule("zb-v", num_ranks=2, num_microbatches=4)  # placement 0 1 1 0
    speeds, caps = per_stage(v, [1.0, 0.5], [800.0, 400.0])
    assert speeds == [1.0, 0.5, 0.5, 1.0]
    assert caps == [400.0, 200.0, 200.0, 400.0]  # a rank's cap is shared by its two stages
    with pytest.raises(ValueError, match="speeds has 3 entries, expected one per rank \\(2\\)"):
        per_stage(v, [1, 1, 1], None)
    with pytest.raises(ValueError, match="memory_caps must be > 0"):
        per_stage(v, None, [1, 0])


def test_in_flight_counts_the_micro_batches_a_stage_holds() -> None:
    assert in_flight(sw.build_schedule("gpipe", 4, 6)) == 6
    assert in_flight(sw.build_schedule("1f1b", 4, 8)) == 4
    assert in_flight(sw.build_schedule("1f1b", 4, 2)) == 2


def test_steadiest_keeps_each_layers_fastest_round() -> None:
    rounds = iter([fake_profile([3.0, 1.0]), fake_profile([1.0, 5.0]), fake_profile([2.0, 2.0])])
    assert steadiest(lambda: next(rounds), 3).times() == pytest.approx([1.0, 1.0])


# ---- profiling a layer list -------------------------------------------------------------------
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x.sum(-1)


class Add(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x + s.unsqueeze(-1)


def test_profile_layers_follows_the_calling_convention_and_keeps_the_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer gets the previous one's outputs as its arguments, and its I is asked for the gradients of those
    that need one: none of the sample's, add's first argument (its second is a sum of the sample), out's input (it
    comes from a layer with weights). Checked on the calls, not on I's time: less the one-node call timed beside
    it, a layer this small takes about none, and noise decides its sign."""
    from stagewise.runtime.measure import layer_cost

    asked: list[list[bool]] = []  # per call of I on a layer: which inputs need a gradient
    real = layer_cost.backward_input

    def recording(outs: Any, grads: Any, inputs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if [tuple(x.shape) for x in inputs] != [(1,)]:  # not the one-node call timed beside it
            asked.append([x.requires_grad for x in inputs])
        return real(outs, grads, inputs, *args, **kwargs)

    monkeypatch.setattr(layer_cost, "backward_input", recording)
    named = named_layers({"pair": sw.Layer(Pair), "add": sw.Layer(Add), "out": sw.Layer(nn.Linear, 4, 2)})
    torch.manual_seed(123)
    sample = torch.randn(3, 4)
    state = torch.random.get_rng_state()
    prof = profile_layers(named, sample, repeats=1, warmup=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert prof.names == ["pair", "add", "out"]
    assert prof["pair"].parameter_bytes == 20 * 4 and prof["add"].parameter_bytes == 0
    # each layer's I runs twice, the same way: once to count what W then holds, once timed
    assert asked == [[], [], [True], [True], [True], [True]], asked  # out's input comes from a layer with weights
    assert [len(r) for r in partition(named, 2, "time", profile=prof)] in ([1, 2], [2, 1])


# ---- whole pipelines on one rank ----------------------------------------------------------------
@pytest.mark.parametrize("tags", ["attr", "with", None])
def test_two_stages_on_one_rank_share_the_models_containers(one_rank, tags: str | None) -> None:
    model = SkipNet(4, 2, tags)
    ref = copy.deepcopy(model)
    options = {} if tags else {"stages": 2, "partition": "parameters"}
    pipe = sw.Pipeline.from_model(model, loss_fn=F.cross_entropy, schedule="zb-v", microbatches=3, **options)
    assert pipe.local_stages == (0, 1)
    assert pipe.get_submodule("blocks.3") is model.blocks[3]  # one "blocks" for both stages, as in the model
    assert sorted(pipe.state_dict()) == sorted(ref.state_dict())  # the non-persistent mask is left out, as there
    (x, scale), y = skip_data(7, seed=1)
    loss = pipe.train_step((x, scale), y)
    ref_loss = F.cross_entropy(ref(x, scale), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    assert assert_grads_close(pipe, ref) == len(list(ref.parameters())), "the one rank holds every parameter"
    torch.testing.assert_close(pipe.eval_step((x, scale)), ref(x, scale), rtol=1e-10, atol=1e-12)
    assert pipe.model_cut.stage_inputs[0] == ("x", "scale")
    assert (pipe.model_cut.blocks == ()) == (tags is not None)


def test_one_rank_keeps_the_model_whole_and_free_unused_false_leaves_it_alone(one_rank) -> None:
    model = SkipNet(2, 2, "attr")
    pipe = sw.Pipeline.from_model(model, loss_fn=F.cross_entropy, schedule="zb-v", free_unused=False)
    assert not any(p.is_meta for p in model.parameters())
    (x, scale), y = skip_data(4, seed=0)
    model(x, scale)  # still usable on its own
    pipe.train_step((x, scale), y)


def test_untagged_time_partition_on_one_rank(one_rank) -> None:
    model = SkipNet(6)
    ref = copy.deepcopy(model)
    (x, scale), y = skip_data(6, seed=2)
    pipe = sw.Pipeline.from_model(
        model, loss_fn=F.cross_entropy, schedule="zb-v", stages=2, partition="time", sample_inputs=(x[:2], scale[:2])
    )
    assert pipe.layer_profile is not None and pipe.layer_profile.names == list(pipe.model_cut.blocks)
    assert sum(len(r) for r in pipe.layer_ranges) == len(pipe.model_cut.blocks) == 8
    pipe.train_step((x, scale), y)
    F.cross_entropy(ref(x, scale), y).backward()
    assert assert_grads_close(pipe, ref) == len(list(ref.parameters())), "the one rank holds every parameter"


def test_layer_lists_time_and_memory_on_one_rank(one_rank) -> None:
    layers = [sw.Layer(nn.Linear, 16, 16) for _ in range(5)] + [sw.Layer(nn.Linear, 16, 3)]
    x, y = torch.randn(8, 16), torch.randint(0, 3, (8,))
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="zb-v", microbatches=2, partition="time", sample_inputs=x[:4]
    )
    assert pipe.layer_profile is not None and len(pipe.layer_profile) == 6
    pipe.train_step(x, y)
    ref = sw.build_model(layers)
    F.cross_entropy(ref(x), y).backward()
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="each shared evenly by the rank's 2 stages"):
        sw.Pipeline(layers, schedule="zb-v", partition="memory", sample_inputs=x[:4], memory_caps=[100.0])
    with pytest.raises(ValueError, match="pass sample_inputs="):
        sw.Pipeline(layers, schedule="zb-v", partition="time")


class Clash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.schedule = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.schedule(x)


def test_from_model_refusals_on_one_rank(one_rank) -> None:
    with pytest.raises(ValueError, match="\\['schedule'\\] clash with Pipeline attributes"):
        sw.Pipeline.from_model(Clash(), free_unused=False)
    with pytest.raises(TypeError, match="parallel= takes a stagewise.ParallelConfig or Mesh"):
        sw.Pipeline.from_model(SkipNet(2, 1, "attr"), parallel=object())
    with pytest.raises(ValueError, match="Pipeline.from_model does not take seed=: the model's weights exist"):
        sw.Pipeline.from_model(SkipNet(2, 1, "attr"), seed=3)
    with pytest.raises(TypeError, match="unknown option 'microbatch' \\(did you mean 'microbatches'\\?\\)"):
        sw.Pipeline.from_model(SkipNet(2, 1, "attr"), microbatch=3)
    with pytest.raises(ValueError, match="stages=3, but the model's tags name 2 stages"):
        sw.Pipeline.from_model(SkipNet(2, 2, "attr"), stages=3, schedule="zb-v")
    with pytest.raises(sw.runtime.SplitError, match="2 stages need at least 2 top-level blocks; the model calls 1"):
        sw.Pipeline.from_model(nn.Sequential(nn.Linear(4, 4)), stages=2, schedule="zb-v")
