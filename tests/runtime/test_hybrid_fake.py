"""A 16-rank mesh (pp 2 x dp 2 x sharding 2 x tp 2) in one process, on torch's fake process group.

The fake group answers every collective without sending anything, so values
are meaningless, but the layout is real: each sampled rank builds the mesh and
checks its groups against the pure arithmetic, then splits (tp) and shards
(HSDP over dp x sharding) a transformer block and measures what it holds.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_checks as hc
import stagewise as sw
from stagewise.parallel import AXES
from stagewise.runtime.hybrid import sharding
from stagewise.runtime.hybrid.mesh import build_mesh
from stagewise.runtime.hybrid.tensor_parallel import apply_plan, local

CONFIG = sw.ParallelConfig(pp=2, dp=2, sharding=2, tp=2)
SAMPLED = (0, 5, 10, 15)


@pytest.fixture(scope="module")
def fake_backend():
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    return FakeStore


@pytest.fixture(params=SAMPLED)
def mesh(request, fake_backend):
    dist.init_process_group("fake", store=fake_backend(), rank=request.param, world_size=CONFIG.world_size)
    try:
        yield build_mesh(CONFIG)
    finally:
        dist.destroy_process_group()


def test_groups_follow_the_arithmetic(mesh) -> None:
    rank = mesh.rank
    assert mesh.coords == CONFIG.coords(rank)
    assert mesh.replica == CONFIG.replica(rank)
    for axis in AXES:
        (expected,) = [g for g in CONFIG.axis_groups(axis) if rank in g]
        assert tuple(dist.get_process_group_ranks(mesh.group(axis))) == expected, axis


def test_split_and_sharded_block_holds_a_quarter(mesh) -> None:
    """Split weights are cut in tp x sharding = 4, the rest (norms, row biases) in sharding = 2; so is the
    AdamW state built over them."""
    block = hc.TPBlock()
    whole = {n: p.numel() for n, p in block.named_parameters()}
    apply_plan(torch.nn.ModuleDict({"1": block}), mesh.sub("tp"), hc.tp_plan())
    sharding.shard_layers([block], mesh.sub("dp", "sharding"))
    split_by_tp = {"q", "k", "v", "fc"}  # column: weight and bias; row: weight only
    for name, p in block.named_parameters():
        module, kind = name.split(".")
        cut = 4 if module in split_by_tp or (module in {"proj", "out"} and kind == "weight") else 2
        assert local(p).numel() * cut == whole[name], (name, local(p).numel(), whole[name])
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(block.parameters())
    opt.step()
    state = sum(local(v).numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    held = sum(local(p).numel() for p in block.parameters())
    assert state == 2 * held  # exp_avg and exp_avg_sq, of this rank's shards only
    assert state / (2 * sum(whole.values())) < 0.3


def test_tied_group_spans_the_owners_in_every_replica_at_one_tp_coordinate(mesh) -> None:
    """A tied embedding / head on pp ranks 0 and 1: its gradient is summed over both stages and averaged over the
    dp x sharding replicas, among the 8 ranks at this rank's tp coordinate (tp ranks hold the same gradient)."""
    from stagewise.runtime.frontends.tied import _replicated

    same_tp = [r for r in range(CONFIG.world_size) if CONFIG.coords(r).tp == mesh.coords.tp]
    every = _replicated(mesh, [0, 1])  # one member list per tp coordinate, this rank's first
    assert every[0] == same_tp
    assert sorted(r for members in every for r in members) == list(range(CONFIG.world_size))  # all made, once
    assert _replicated(mesh, [1])[0] == [r for r in same_tp if CONFIG.coords(r).pp == 1]  # V: both uses on one rank
    assert mesh.rank in _replicated(mesh, [mesh.coords.pp])[0]
