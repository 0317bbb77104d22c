"""The checkpoint package's one door to ``torch.distributed``: the ranks taking part, a few collectives, and DCP.

Tensors are written and read by ``torch.distributed.checkpoint`` (DCP), which
reshards DTensors (FSDP2 and tensor-parallel shards) at load time and writes a
replicated tensor once. DCP's own ``.metadata`` file is a pickle; it is read
here with an unpickler that builds only DCP's metadata classes, dtypes and
sizes (:class:`SafeReader`), and the tensors themselves with DCP's
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .manifest import CheckpointError


@dataclass(frozen=True)
class Ranks:
    """The processes that save or load one checkpoint together: a process group, or this process alone."""

    group: Any
    rank: int
    size: int
    device: torch.device
    distributed: bool

    @property
    def first(self) -> bool:
        return self.rank == 0


def pipeline_ranks(pipe: Any) -> Ranks:
    """Every rank of the pipeline's mesh (all processes with ``parallel=``), or of its pipeline group."""
    group = dist.group.WORLD if pipe.hybrid is not None else pipe.transport.group
    return Ranks(group, dist.get_rank(group), dist.get_world_size(group), torch.device(pipe.device), True)


def module_ranks(collective: bool) -> Ranks:
    """For a plain module: every process of the default group (``collective`` and initialised), or this one."""
    if collective and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        return Ranks(group, dist.get_rank(), dist.get_world_size(), torch.device(device), True)
    return Ranks(None, 0, 1, torch.device("cpu"), False)


def gather(obj: Any, ranks: Ranks) -> list[Any]:
    """``obj`` of every rank, in rank order, on every rank (JSON-like values only)."""
    if not ranks.distributed:
        return [obj]
    out: list[Any] = [None] * ranks.size
    dist.all_gather_object(out, obj, group=ranks.group)
    return out


def agree(problems: list[str], ranks: Ranks, what: str) -> None:
    """Raise the same :class:`CheckpointError` on every rank if any rank found a problem (a collective).

    Every rank takes part even when it found nothing, so no rank goes on into
    a collective that another has abandoned.
    """
    everyone = gather(problems, ranks)
    found = [(r, p) for r, ps in enumerate(everyone) for p in ps]
    if not found:
        return
    seen: dict[str, list[int]] = {}
    for r, p in found:
        seen.setdefault(p, []).append(r)
    lines = [f"  {p}" + ("" if ranks.size == 1 else f" (rank {', '.join(map(str, rs))})") for p, rs in seen.items()]
    shown = lines[:20] + ([f"  ... and {len(lines) - 20} more"] if len(lines) > 20 else [])
    raise CheckpointError(f"{what}:\n" + "\n".join(shown))


def barrier(ranks: Ranks, deadline_s: float, what: str) -> None:
    """Wait until every rank arrives, at most ``deadline_s`` seconds; raise naming ``what`` otherwise."""
    if not ranks.distributed:
        return
    token = torch.zeros(1, device=ranks.device)
    work = dist.all_reduce(token, group=ranks.group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=deadline_s))
    except Exception as err:  # the backend's timeout error type differs between gloo and NCCL
        raise CheckpointError(f"rank {ranks.rank}: not every rank {what} within {deadline_s:g} s ({err})") from err


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks) -> None:
    """Write this rank's share of the flat name -> tensor dict (a collective: replicated names are written once)."""
    writer = FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=True)
    with _quiet():
        dcp.save(tensors, storage_writer=writer, process_group=ranks.group, no_dist=not ranks.distributed)


def load_tensors(tensors: dict[str, torch.Tensor], folder: Path, ranks: Ranks) -> None:
    """Fill ``tensors`` in place from the checkpoint (a collective: DCP reads the pieces each one needs)."""
    reader = SafeReader(str(folder))
    with _quiet():
        dcp.load(tensors, storage_reader=reader, process_group=ranks.group, no_dist=not ranks.distributed)


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when told to (``no_dist=True``): that is what was asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class SafeReader(FileSystemReader):
    """DCP's file reader, but its metadata pickle may only build DCP metadata classes, dtypes and sizes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"file {path} holds something other than DCP metadata: {err}") from err
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_ALLOWED = {
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
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _ALLOWED:
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in _ALLOWED:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}")
