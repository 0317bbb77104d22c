"""The profiles a pipeline takes while it is built record the layers tied across the list, as ``sw.profile``
does (tests/runtime/test_profile_tied.py): ``partition="time"``'s, the default cut's (timed or counted) and
``from_model``'s blocks', so that the default cut's word and a run's calibration price the tied gradient sum."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_grads_close
from helpers.nets import VOCAB, D, SkipNet, TiedNet, skip_data, token_loss
from stagewise.runtime import split_model
from stagewise.runtime.frontends import default_cut
from stagewise.runtime.frontends.layers import named_layers

V, W = 16, 8  # a layer list's vocabulary and width


def _logits(tokens: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ tokens.weight.t()


def _tied_list() -> list[sw.Layer]:
    return [
        sw.Tied("tok", sw.Layer(nn.Embedding, V, W)),
        sw.Layer(nn.Linear, W, W),
        sw.Layer(nn.Linear, W, W),
        sw.Tied("tok", forward_fn=_logits),
    ]


def _list_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def test_a_time_partition_of_a_tied_list_records_the_set_and_times_the_head_as_its_product(one_rank) -> None:
    """The head (a later use, no parameter of its own) is timed calling the embedding's matrix, as the pipeline
    runs it: it sends the logits, and saves the matrix as a parameter, not an activation, as in ``sw.profile``."""
    layers, ids = _tied_list(), torch.randint(0, V, (4, 5))
    pipe = sw.Pipeline(
        layers, loss_fn=_list_loss, schedule="zb-v", microbatches=2, partition="time", sample_inputs=ids[:2]
    )
    prof = pipe.layer_profile
    assert prof is not None and prof.tied == (((0, 3), V * W * 4.0),)
    assert pipe.tied.layer_sets == ((0, 3),)  # the set the runtime sums, by the same indices
    whole = sw.profile(sw.build_model(layers), ids[:2], repeats=1, warmup=0)
    assert prof["3"].output_bytes == 2 * 5 * V * 4  # the logits, not the hidden state passed through
    assert [(c.activation_bytes, c.parameter_bytes) for c in prof.layers] == [
        (c.activation_bytes, c.parameter_bytes) for c in whole.layers
    ]
    pipe.train_step(ids, torch.randint(0, V, (4, 5)))  # a profile with ties builds and runs as one without


def test_the_default_cut_s_counted_and_timed_profiles_record_the_set() -> None:
    """Dense layers are counted on the meta device, a list holding a convolution is timed: both record the tie,
    and the word's estimate takes such a profile as it takes one without."""
    schedule = sw.build_schedule("zb-v", num_ranks=2, num_microbatches=4)
    cut = default_cut.decide(
        named_layers(_tied_list()), schedule, sample_inputs=torch.randint(0, V, (2, 5)), speeds=None, seed=0,
        device="cpu",
    )  # fmt: skip
    assert cut.source == "counted" and cut.profile is not None
    assert cut.profile.tied == (((0, 3), V * W * 4.0),)
    assert default_cut.unplain(default_cut.plain(cut)) == cut  # what rank 0 hands the others
    default_cut.warn_if_slower(schedule, cut, rank=0)
    convs = [sw.Tied("c", sw.Layer(nn.Conv1d, 4, 4, 3, padding=1)), sw.Layer(nn.Conv1d, 4, 4, 3, padding=1),
             sw.Tied("c")]  # fmt: skip
    timed = default_cut.decide(
        named_layers(convs), sw.build_schedule("1f1b", 2, 4), sample_inputs=torch.randn(2, 4, 9), speeds=None,
        seed=0, device="cpu",
    )  # fmt: skip
    assert timed.source == "timed" and timed.profile is not None
    assert timed.profile.tied == (((0, 2), (4 * 4 * 3 + 4) * 4.0),)


@pytest.mark.parametrize("partition", ["time", "balanced"])
def test_from_model_s_block_profile_ties_the_embedding_s_block_and_the_head_s(one_rank, partition: str) -> None:
    """``head.weight = embed.weight``: blocks ``embed, blocks.0, blocks.1, head``, the first and the last tied, by
    block index, in the profile and in the set the pipeline sums (the head's block, not its stage's first)."""
    model = TiedNet(2, functional=False)
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, VOCAB, (4, 5)), torch.randint(0, VOCAB, (4, 5))
    pipe = sw.Pipeline.from_model(
        model, loss_fn=token_loss, schedule="zb-v", stages=2, partition=partition, sample_inputs=ids[:2]
    )
    prof = pipe.layer_profile
    assert prof is not None and prof.names == ["embed", "blocks.0", "blocks.1", "head"]
    assert prof.tied == (((0, 3), VOCAB * D * 8.0),)
    assert pipe.tied.layer_sets == ((0, 3),)
    pipe.train_step(ids, y)
    token_loss(ref(ids), y).backward()
    assert assert_grads_close(pipe, ref, aliases=True) > 0


def test_an_untied_model_and_a_tie_inside_one_block_record_none(one_rank) -> None:
    """A tie inside one block is no tie across stages: no set, as for a model tying nothing."""
    (x, scale), _ = skip_data(4, seed=0)
    pipe = sw.Pipeline.from_model(
        SkipNet(2), loss_fn=F.cross_entropy, schedule="zb-v", stages=2, partition="time", sample_inputs=(x, scale)
    )
    assert pipe.layer_profile is not None and pipe.layer_profile.tied == ()
    twice = nn.Sequential(_Twice(), nn.Linear(W, W), nn.Linear(W, W))
    pipe = sw.Pipeline.from_model(
        twice, loss_fn=F.mse_loss, schedule="zb-v", stages=2, partition="time", sample_inputs=torch.randn(2, W)
    )
    assert pipe.layer_profile is not None and pipe.layer_profile.tied == ()


class _Twice(nn.Module):
    """One block applying one matrix twice (two names of one parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_split_model_s_given_profile_keeps_its_ties_by_block_index() -> None:
    """A profile given as ``costs=`` (its layers in another order) is re-indexed by the blocks, its ties too."""
    model = TiedNet(2, functional=False)
    prof = sw.profile(model, torch.randint(0, VOCAB, (2, 4)), repeats=1, warmup=0)
    backwards = replace(prof, layers=prof.layers[::-1], tied=(((0, 2), 5.0),))  # head, blocks.1, blocks.0, embed
    split = split_model(model, stages=2, costs=backwards)
    assert split.profile is not None and split.profile.names == ["embed", "blocks.0", "blocks.1", "head"]
    assert split.profile.tied == (((1, 3), 5.0),)  # head and blocks.0
    timed = split_model(model, torch.randint(0, VOCAB, (2, 4)), stages=2, partition="time", repeats=1)
    assert timed.profile is not None and timed.profile.tied == (((0, 3), VOCAB * D * 8.0),)
