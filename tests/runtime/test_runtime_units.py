"""Runtime pieces in one process: nested values, micro-batching, layer specs, partitions.

Whole pipelines on a one-rank process group are in test_one_rank.py; the I/W split in test_split_backward.py."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime.engine.microbatch import batch_size, merge, split
from stagewise.runtime.engine.tree import flatten, leaf_paths, spec_difference, unflatten
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


def test_a_changed_structure_is_named_where_it_first_differs() -> None:
    """The words a structure change across a stage gets: the first path that differs, and what it was."""
    t = torch.ones(1)

    def spec(value: object) -> tuple:
        return flatten(value)[1]

    assert spec_difference(spec((t, t, t)), spec((t, t, None))) == "output[2] is a tensor, where it was None"
    assert (
        spec_difference(spec((t, t)), spec((t, t, None)), "input") == "input is a tuple of 2, where it was a tuple of 3"
    )
    got = spec_difference(spec({"x": t, "p": Pair(t, 3)}), spec({"x": t, "p": Pair(t, 2)}))
    assert got == "output['p'].b is 3, where it was 2"
    assert (
        spec_difference(spec({"x": t}), spec({"y": t}))
        == "output is a dict of keys ['x'], where it was a dict of keys ['y']"
    )
    assert spec_difference(spec([t, "s"]), spec((t, "s"))) == "output is a list of 2, where it was a tuple of 2"
    assert spec_difference(spec((t, [1])), spec((t, [1]))) == ""


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
    with pytest.raises(ValueError, match="must be 'balanced', 'uniform', 'parameters'"):
        partition(named, 2, "fast")


def test_too_few_samples_per_replica_quotes_the_global_batch_and_the_replicas_share() -> None:
    """dp=2: the user passes a global batch of 4 through local_batch, each replica trains on 2; 4 micro-batches need
    4 samples per replica. The message used to quote only "a batch of 2", which the user never passed."""
    from stagewise.runtime.engine.batches import prepare_window

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
