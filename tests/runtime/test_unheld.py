"""A block reaching another block's parameter through a reference kept outside its module tree
(runtime/frontends/unheld.py): the stage's first forward names it where the rank does not hold it; on a rank
holding both stages it is the parameter itself, and trains as the model does. Across 2 ranks:
tests/distributed/workers/from_model_checks.py's ``hidden-tie``."""

from __future__ import annotations

import copy

import pytest
import torch

import stagewise as sw
from helpers.compare import assert_grads_close
from helpers.nets import VOCAB, HiddenTieNet, token_loss
from stagewise.runtime import split_model
from stagewise.runtime.frontends.unheld import watch_first_forward


def test_a_stage_using_a_parameter_its_rank_does_not_hold_names_it_its_owner_and_its_user() -> None:
    model = HiddenTieNet(2)
    split = split_model(model, stages=2, partition=[2, 2])
    assert split.tied == {}  # the tie no registration and no traced forward shows
    last = split.stage_modules[1]
    watch_first_forward({1: last}, model, split.module_stages)  # as on the rank holding stage 1 only
    ids = torch.randint(0, VOCAB, (2, 3))
    h = split.stage_modules[0](ids)
    with pytest.raises(sw.runtime.SplitError) as err:
        last(*h)
    assert str(err.value).startswith(
        "'head' (stage 1) uses the parameter 'embed.weight' of 'embed' (stage 0), which this rank does not hold"
    )
    assert "holds a copy whose gradient no rank would sum" in str(err.value)
    assert "forward" not in vars(last)  # one forward watched, the later ones are the graph's own
    torch.testing.assert_close(last(*h), model(ids))


def test_on_one_rank_holding_both_stages_it_is_the_parameter_itself(one_rank) -> None:
    model = HiddenTieNet(2)
    ref = copy.deepcopy(model)
    pipe = sw.Pipeline.from_model(model, loss_fn=token_loss, schedule="zb-v", stages=2, microbatches=2)
    ids, y = torch.randint(0, VOCAB, (4, 3)), torch.randint(0, VOCAB, (4, 3))
    loss = pipe.train_step(ids, y)
    ref_loss = token_loss(ref(ids), y)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    assert assert_grads_close(pipe, ref) == len(list(ref.parameters()))
