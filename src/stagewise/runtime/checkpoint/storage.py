"""The checkpoint package's one door to ``torch.distributed``: the ranks taking part, their collectives, and DCP.

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
``rank-K/.metadata`` into one (:class:`SafeReader`) and DCP reads the pieces
each rank needs. A one-process save keeps DCP's plain layout (one
``.metadata`` beside the data), which loads the same way.

DCP's ``.metadata`` files are pickles; they are read with an unpickler that
builds only a fixed list of DCP's metadata classes (:data:`_ALLOWED`), torch's
dtypes and sizes; the tensors themselves with DCP's
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from ..comm.collectives import all_reduce_async, gather_json
from ..comm.faults.guard import Guard, setup_guard
from .manifest import CheckpointError

Piece = tuple[str, tuple[int, ...]]  # a name and the offset of a piece of it (a DTensor's shard; () for a scalar)
_SHARE = re.compile(r"^rank-(\d+)$")


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


def pipeline_ranks(pipe: Any, patience: float) -> Ranks:
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
    everyone = gather(problems, ranks, f"every rank's verdict ({what})", patient=patient)
    found = [(r, p) for r, ps in enumerate(everyone) for p in ps]
    if not found:
        return
    seen: dict[str, list[int]] = {}
    for r, p in found:
        seen.setdefault(p, []).append(r)
    lines = [f"  {p}" + ("" if ranks.size == 1 else f" (rank {', '.join(map(str, rs))})") for p, rs in seen.items()]
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


# ---- DCP, rank by rank ----------------------------------------------------------------------------
def pieces(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """The pieces this rank would write, as DCP plans them (``[name, offset]``: a DTensor's local shard, or a
    whole tensor at offset 0): plain data, to gather."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(tensors, is_coordinator=True)
    return [[item.index.fqn, list(item.index.offset or ())] for item in planner.create_local_plan().items]


def assigned(everyone: list[list[list[Any]]], rank: int) -> set[Piece]:
    """The pieces ``rank`` writes: each piece once, by the lowest rank that holds it."""
    writer: dict[Piece, int] = {}
    for r, mine in enumerate(everyone):
        for name, offset in mine:
            writer.setdefault((name, tuple(offset)), r)
    return {piece for piece, r in writer.items() if r == rank}


class _Only(DefaultSavePlanner):
    """DCP's planner, keeping only the pieces this rank was assigned."""

    def __init__(self, mine: set[Piece]) -> None:
        super().__init__()
        self.mine = mine

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        kept = [i for i in plan.items if (i.index.fqn, tuple(i.index.offset or ())) in self.mine]
        self.plan = dataclasses.replace(plan, items=kept)
        return self.plan


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks, mine: set[Piece] | None = None) -> None:
    """Write this rank's share of the flat name -> tensor dict (``mine``: the pieces it writes, see
    :func:`assigned`; all of them when None) into ``folder/rank-K`` (the folder itself in one process)."""
    if not ranks.distributed:
        target, planner = folder, None
    else:
        target = folder / f"rank-{ranks.rank}"
        target.mkdir(parents=True, exist_ok=True)
        planner = None if mine is None else _Only(mine)
    writer = FileSystemWriter(str(target), single_file_per_rank=True, sync_files=True)
    with _quiet(), _unwrapped(f"writing checkpoint {folder}"):
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=True)


def load_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks) -> None:
    """Fill ``tensors`` in place from the checkpoint: DCP reads the pieces this rank needs, on this rank alone."""
    with _quiet(), _unwrapped(f"reading checkpoint {folder}"):
        dcp.load(tensors, storage_reader=SafeReader(str(folder)), no_dist=True)


@contextmanager
def _unwrapped(what: str) -> Iterator[None]:
    """DCP wraps whatever its reads and writes raise in a ``CheckpointException`` (a BaseException): a Ctrl-C
    is handed on as the ``KeyboardInterrupt`` it was (so the job stops with its one line, not a traceback),
    a CheckpointError as itself, anything else as a :class:`CheckpointError` naming the folder and the cause."""
    try:
        yield
    except CheckpointException as err:
        causes = [exc for exc, _ in err.failures.values()]
        if any(isinstance(exc, KeyboardInterrupt) for exc in causes):
            raise KeyboardInterrupt from None
        known = [exc for exc in causes if isinstance(exc, CheckpointError)]
        if known:
            raise known[0] from None
        first = causes[0] if causes else err
        raise CheckpointError(f"{what}: {type(first).__name__}: {first}") from err


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when told to (``no_dist=True``): that is what was asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class SafeReader(FileSystemReader):
    """DCP's file reader over a checkpoint folder: every ``rank-K/.metadata`` merged into one (or the folder's own
    ``.metadata``), each read by an unpickler that builds only DCP's metadata classes, dtypes and sizes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        folder = Path(self.path)
        if (folder / ".metadata").is_file():
            metadata = read_metadata_file(folder / ".metadata")
        else:
            metadata = merged(folder)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def merged(folder: Path) -> Any:
    """One DCP ``Metadata`` for the shares ``folder/rank-K`` (see the module docstring): every name's pieces, each
    piece's bytes found in the share that wrote it."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    shares = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _SHARE.match(p.name)) and p.is_dir())
    if not shares:
        raise CheckpointError(f"checkpoint {folder} holds no tensors: neither a .metadata nor rank-K/ shares")
    state: dict[str, Any] = {}
    data: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    version = None
    for _, share in shares:
        part = read_metadata_file(share / ".metadata")
        version = version or part.version
        for name, meta in part.state_dict_metadata.items():
            have = state.get(name)
            if not isinstance(meta, TensorStorageMetadata):
                state.setdefault(name, meta)
            elif have is None:
                state[name] = TensorStorageMetadata(meta.properties, meta.size, list(meta.chunks))
            else:
                offsets = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in offsets)
        for index, info in (part.storage_data or {}).items():
            if index not in data:
                data[index] = dataclasses.replace(info, relative_path=f"{share.name}/{info.relative_path}")
        planner.update(part.planner_data or {})
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=data, version=version)


def read_metadata_file(path: Path) -> Any:
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(io.BytesIO(f.read())).load()
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"file {path} holds something other than DCP metadata: {err}") from err


_DCP = "torch.distributed.checkpoint"
#: every class DCP's metadata pickle may build (torch 2.13), and nothing else
_ALLOWED = {
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)  # a dtype, layout or memory format: values, not classes
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}")
