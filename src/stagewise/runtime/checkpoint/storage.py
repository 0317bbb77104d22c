"""The checkpoint package's one door to ``torch.distributed``: the ranks taking part, their collectives, and DCP
(through :mod:`.dcp_files`, imported at the first save or load).

Every collective of a save or a load is stagewise's own: JSON records in
tensors (:func:`..comm.collectives.gather_json`), waited for through the
pipeline's guard, so a wait ends within the pipeline's timeout or at any
rank's failure on the error board, and names a rank that stopped. (A wait
behind slow local work - writing or hashing a share of a large checkpoint -
may last the save's or load's ``timeout`` while every rank shows signs of
life.) Nothing a peer sends is unpickled.

Tensors are written and read by ``torch.distributed.checkpoint`` (DCP), which
reshards DTensors (FSDP2 and tensor-parallel shards) at load time - run on
each rank alone (``no_dist``): DCP's own planning collectives pickle every
rank's plan (``all_gather_object``) and wait on torch's group timeout. So each
rank writes its share into ``rank-K/`` with its own ``.metadata``; a piece
several ranks hold (a replicated tensor, a tied copy, the same shard on two
replicas) is written once, by the lowest rank holding it, decided from the
gathered plans (:func:`pieces`, :func:`assigned`). A load merges every
``rank-K/.metadata`` into one (:class:`.dcp_files.SafeReader`) and DCP reads the pieces
each rank needs. A one-process save keeps DCP's plain layout (one
``.metadata`` beside the data), which loads the same way.

DCP's ``.metadata`` files are pickles; they are read with an unpickler that
builds only a fixed list of DCP's metadata classes (:data:`.dcp_files._ALLOWED`), torch's
dtypes and sizes; the tensors themselves with DCP's
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_async, gather_json
from ..comm.faults.guard import Guard, setup_guard
from .declared import PipelineState
from .manifest import CheckpointError

Piece = tuple[str, tuple[int, ...]]  # a name and the offset of a piece of it (a DTensor's shard; () for a scalar)


@dataclass(frozen=True)
class Ranks:
    """The processes that save or load one checkpoint together: a process group, or this process alone.

    ``guard``: whose deadline and error board every wait goes through (the pipeline's, or one of its own for a
    plain module: ``own_guard``); ``patience``: how long a wait behind the others' local work may last while
    every rank shows signs of life.
    """

    group: Any
    rank: int
    size: int
    device: torch.device
    distributed: bool
    guard: Guard | None = None
    patience: float = 600.0
    own_guard: bool = False

    @property
    def first(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Stop the helper threads of a guard made for this save or load."""
        if self.own_guard and self.guard is not None:
            self.guard.close()


def pipeline_ranks(pipe: PipelineState, patience: float) -> Ranks:
    """Every rank of the pipeline's mesh (all processes with ``parallel=``), or of its pipeline group; waits go
    through the pipeline's guard."""
    group = dist.group.WORLD if pipe.hybrid is not None else pipe.transport.group
    guard = pipe.transport.guard
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return Ranks(group, rank, size, torch.device(pipe.device), True, guard, patience)


def module_ranks(collective: bool, timeout: float) -> Ranks:
    """For a plain module: every process of the default group (``collective`` and initialised), whose waits end
    after ``timeout`` seconds or at a failure posted for the job; or this process alone."""
    if collective and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        guard = setup_guard(timeout)
        return Ranks(group, dist.get_rank(), dist.get_world_size(), torch.device(device), True, guard, timeout, True)
    return Ranks(None, 0, 1, torch.device("cpu"), False)


def gather(obj: Any, ranks: Ranks, what: str, *, patient: bool = False) -> list[Any]:
    """``obj`` of every rank (JSON-like), in rank order, on every rank. ``patient``: the others may still be busy
    with local work for up to ``ranks.patience`` (see :class:`Ranks`)."""
    if not ranks.distributed:
        return [obj]
    guard = ranks.guard
    assert guard is not None
    patience = ranks.patience if patient else None

    def wait(works: Any, label: str) -> None:
        guard.wait(works, label, patience=patience)

    return gather_json(obj, ranks.group, wait, what)


def agree(problems: list[str], ranks: Ranks, what: str, *, patient: bool = False) -> None:
    """Raise the same :class:`CheckpointError` on every rank if any rank found a problem (a collective).

    Every rank takes part even when it found nothing, so no rank goes on into
    a collective that another has abandoned.
    """
    refuse_alike(gather(problems, ranks, f"every rank's verdict ({what})", patient=patient), what)


def refuse_alike(everyone: list[list[str]], what: str) -> None:
    """Raise one :class:`CheckpointError` naming every rank's problems (``everyone[r]``: rank r's), if any: the
    same on every rank that gathered the same lists."""
    found = [(r, p) for r, ps in enumerate(everyone) for p in ps]
    if not found:
        return
    seen: dict[str, list[int]] = {}
    for r, p in found:
        seen.setdefault(p, []).append(r)
    lines = [f"  {p}" + ("" if len(everyone) == 1 else f" (rank {', '.join(map(str, rs))})") for p, rs in seen.items()]
    shown = lines[:20] + ([f"  ... and {len(lines) - 20} more"] if len(lines) > 20 else [])
    raise CheckpointError(f"{what}:\n" + "\n".join(shown))


def barrier(ranks: Ranks, what: str) -> None:
    """Wait until every rank has arrived, behind local work of up to ``ranks.patience`` seconds."""
    if not ranks.distributed:
        return
    guard = ranks.guard
    assert guard is not None
    token = torch.zeros(1, device=ranks.device)
    label = f"every rank to have {what}"
    guard.wait([all_reduce_async(token, ranks.group)], label, patience=ranks.patience)
    guard.wait_gpu(ranks.device, label, ranks.patience)  # NCCL only orders streams: the host waits here


# ---- DCP, rank by rank (.dcp_files, imported at the first save or load) ----------------------------------
def pieces(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """The pieces this rank would write, as DCP plans them (``[name, offset]``: a DTensor's local shard, or a
    whole tensor at offset 0): plain data, to gather."""
    from . import dcp_files

    return dcp_files.pieces(tensors)


def assigned(everyone: list[list[list[Any]]], rank: int) -> set[Piece]:
    """The pieces ``rank`` writes: each piece once, by the lowest rank that holds it."""
    writer: dict[Piece, int] = {}
    for r, mine in enumerate(everyone):
        for name, offset in mine:
            writer.setdefault((name, tuple(offset)), r)
    return {piece for piece, r in writer.items() if r == rank}


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks, mine: set[Piece] | None = None) -> None:
    """Write this rank's share of the flat name -> tensor dict (``mine``: the pieces it writes, see
    :func:`assigned`; all of them when None) into ``folder/rank-K`` (the folder itself in one process)."""
    from . import dcp_files

    if not ranks.distributed:
        target, mine = folder, None
    else:
        target = folder / f"rank-{ranks.rank}"
        target.mkdir(parents=True, exist_ok=True)
    dcp_files.write(tensors, target, mine, f"writing checkpoint {folder}")


def load_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks) -> None:
    """Fill ``tensors`` in place from the checkpoint: DCP reads the pieces this rank needs, on this rank alone."""
    from . import dcp_files

    dcp_files.read(tensors, folder, f"reading checkpoint {folder}")
