"""The re-layout's pure parts, without processes: which tensor moves from where to where, the request's checks."""

from __future__ import annotations

import pytest

from stagewise.runtime.relayout.request import digest, members_of, refuse_alike, subgroups_ahead
from stagewise.runtime.relayout.transfers import Move, bytes_moved, plan_transfers


def test_a_tensor_kept_on_its_process_does_not_move_and_others_come_from_the_lowest_holder() -> None:
    held = [["a", "b"], ["b", "c"], []]
    needed = [["a"], ["a", "c"], ["b", "c"]]
    t = plan_transfers(held, needed)
    assert t.kept == {0: ("a",), 1: ("c",), 2: ()}
    assert t.moves == (Move("a", 0, 1), Move("b", 0, 2), Move("c", 1, 2))  # b from 0, the lowest holder
    assert t.missing == {}
    assert bytes_moved(t, {"a": 8, "b": 16, "c": 4}) == 28


def test_a_name_no_process_holds_is_missing() -> None:
    t = plan_transfers([["a"], []], [[], ["a", "z"]])
    assert t.missing == {1: ("z",)} and t.moves == (Move("a", 0, 1),)


def test_lists_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="held lists 2 processes but needed lists 1"):
        plan_transfers([[], []], [[]])


def test_members_are_checked_and_sorted() -> None:
    assert members_of(None, 3) == (0, 1, 2)
    assert members_of([2, 0], 4) == (0, 2)
    for bad in ([], [0, 4], [1, 1], [-1]):
        with pytest.raises(ValueError, match="members must be distinct global ranks 0 to 3"):
            members_of(bad, 4)


def test_the_digest_tells_requests_apart() -> None:
    assert digest((0, 1), {"schedule": "zb-v"}, None) == digest((0, 1), {"schedule": "zb-v"}, None)
    assert digest((0, 1), {"schedule": "zb-v"}, None) != digest((0, 1), {"schedule": "1f1b"}, None)
    assert digest((0, 1), {}, None) != digest((0, 1, 2), {}, None)


def test_refusals_name_every_process_alike() -> None:
    refuse_alike([{"digest": "x", "refused": []}, {"digest": "x", "refused": []}])
    with pytest.raises(ValueError, match=r"processes \[1\] asked y"):
        refuse_alike([{"digest": "x", "refused": []}, {"digest": "y", "refused": []}])
    with pytest.raises(ValueError, match="process 1: inside a merge"):
        refuse_alike([{"digest": "x", "refused": []}, {"digest": "x", "refused": ["inside a merge"]}])


def test_groups_made_ahead_for_fewer_processes() -> None:
    assert subgroups_ahead((0, 1, 2, 3), 4) == []
    assert subgroups_ahead((0, 1), 4) == [(0, 1)]
    assert len(subgroups_ahead((0, 1, 2), 4)) == 4  # three pairs and the three
    assert subgroups_ahead(tuple(range(6)), 8) == [tuple(range(6))]


def test_each_way_in_refuses_what_it_cannot_change() -> None:
    from torch import nn

    import stagewise as sw
    from stagewise.runtime.checkpoint.declared import Progress
    from stagewise.runtime.frontends.given import GivenStages
    from stagewise.runtime.frontends.layer_list import LayerList
    from stagewise.runtime.options import Options
    from stagewise.runtime.relayout.request import local_refusals

    calm = Progress(train_steps=3, dropout_seed=0, merged_steps=0, asynchronous=False)
    layers = LayerList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert local_refusals(layers, Options(), calm, {"partition": [1, 1]}) == []
    assert "loss_fn= is not a layout option" in local_refusals(layers, Options(), calm, {"loss_fn": None})[0]
    merging = Progress(train_steps=3, dropout_seed=0, merged_steps=2, asynchronous=False)
    assert "gradient merge (2 train steps" in local_refusals(layers, Options(), merging, {})[0]
    given = GivenStages({0: nn.Linear(2, 2)})
    assert local_refusals(given, Options(), calm, {"schedule": "gpipe"}) == []  # the same placement
    assert "keeps its placement: partition" in local_refusals(given, Options(), calm, {"partition": [1]})[0]
    from stagewise.runtime.relayout.request import placement_refusals

    assert placement_refusals(given, (0, 1, 2, 3), (0, 1, 2, 3)) == []  # the same processes
    assert "[0, 1, 2, 3] cannot become [0, 1]" in placement_refusals(given, (0, 1, 2, 3), (0, 1))[0]
    assert placement_refusals(layers, (0, 1, 2, 3), (0, 1)) == []  # a layer list is cut again for them
    assert placement_refusals(given, None, (0, 1)) == []  # a retired process holds no placement to keep
    tp = {"parallel": sw.ParallelConfig(pp=2, tp=2)}
    assert "tensor parallelism and sharding" in local_refusals(layers, Options(), calm, tp)[0]
    import torch

    scheduled = Options(optimizer=torch.optim.SGD, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    assert local_refusals(layers, scheduled, calm, {"partition": [1, 1]}) == []  # its state is carried over
    from stagewise.runtime.frontends.from_model import FromModel

    built = FromModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert local_refusals(built, Options(), calm, {"partition": [1, 1]}) == []  # its meta twin is cut again
    assert "profiles the model" in local_refusals(built, Options(), calm, {"partition": "time"})[0]
