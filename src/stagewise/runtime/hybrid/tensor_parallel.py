"""Tensor parallelism (Megatron-style) over the ``tp`` axis, with torch's DTensor tensor-parallel styles.

A *plan* says which layers of the model are split, by qualified module name
in the one-process model (``fnmatch`` patterns, ``*`` crossing dots), e.g.
for a transformer block with separate ``q``/``k``/``v`` projections::

    plan = {
        "0": sw.runtime.vocab_parallel_embedding(),        # the token embedding, vocabulary split
        "*.q": sw.runtime.column_parallel(), "*.k": sw.runtime.column_parallel(), "*.v": sw.runtime.column_parallel(),
        "*.proj": sw.runtime.row_parallel(),               # attention output: partial sums, one all-reduce
        "*.fc": sw.runtime.column_parallel(), "*.out": sw.runtime.row_parallel(),
    }

Each rank applies the entries that match its own stages' modules. The styles
(Shoeybi et al., Megatron-LM, 2019, Sec. 3):

* column-parallel ``Y = X A``, ``A = [A_1 .. A_t]`` split by output features:
  rank ``i`` computes ``Y_i = X A_i`` (no communication forward; the input
  gradient is all-reduced backward). Its output stays split unless gathered.
* row-parallel, ``A`` split by input features: takes the split ``Y_i`` of a
  column-parallel layer, computes ``Y_i A_i`` and sums them (one all-reduce).
* vocab-parallel embedding: the table split by vocabulary rows; a rank looks up
  the ids it holds (zeros for the others), then the partial results are summed.

A column/row pair therefore costs one all-reduce forward and one backward. A
layer between them sees its rank's share of the features: attention must
count its heads from the tensor (``x.shape[-1] // head_dim``), not from the
configured total.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

#: module-name pattern -> how that module is split
TPPlan = Mapping[str, ParallelStyle]


def column_parallel(*, gather_output: bool = False) -> ParallelStyle:
    """``nn.Linear`` split by output features; the output stays split unless ``gather_output``."""
    return ColwiseParallel(output_layouts=Replicate() if gather_output else Shard(-1))


def row_parallel() -> ParallelStyle:
    """``nn.Linear`` split by input features: split input (a column layer's output), summed output."""
    return RowwiseParallel()


def vocab_parallel_embedding() -> ParallelStyle:
    """``nn.Embedding`` split by vocabulary rows; every rank gets the whole (summed) embedding."""
    return RowwiseParallel(input_layouts=Replicate())


def apply_plan(root: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> list[str]:
    """Split the submodules of ``root`` whose names match a key of ``plan``; returns their names.

    Every rank built the same (seeded) full layers, so each keeps its own
    slice and nothing is sent. A module matched by two keys is an error.
    """
    split = []
    for name, module in list(root.named_modules()):
        if not name:
            continue
        keys = [k for k in plan if fnmatchcase(name, k)]
        if len(keys) > 1:
            raise ValueError(f"module {name!r} matches several tensor-parallel plan keys: {keys}")
        if keys:
            parallelize_module(module, tp_mesh, plan[keys[0]], src_data_rank=None)
            split.append(name)
    return split


@torch.no_grad()
def align_grad(p: torch.Tensor) -> None:
    """Give ``p.grad`` the placements of ``p`` (no communication: a replicated gradient is sliced).

    Autograd may leave a split parameter with a whole gradient - the
    vocab-parallel embedding's comes back replicated - which would double its
    memory and its data-parallel traffic.
    """
    g = p.grad
    if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def pieces(t: torch.Tensor) -> int:
    """Into how many distinct pieces ``t`` is cut over the mesh (1 for a plain tensor or a replicated DTensor)."""
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for dim, placement in enumerate(t.placements):
        if not (placement.is_replicate() or placement.is_partial()):  # Shard, and FSDP's _StridedShard
            n *= t.device_mesh.size(dim)
    return n


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over the DTensor's mesh; plain tensors are returned as they are)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
