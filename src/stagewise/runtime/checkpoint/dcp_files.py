"""DCP's files, rank by rank: the pieces a rank writes, its share written and read, the shares' metadata merged
and unpickled safely (see :mod:`.storage` for why each rank runs DCP alone).

Imported by :mod:`.storage` at the first save or load, not with the library: ``torch.distributed.checkpoint``
and the DTensor modules it loads cost a third of a second of CPU in every process that imports them, and most
ranks of most jobs never checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from .manifest import CheckpointError

Piece = tuple[str, tuple[int, ...]]  # a name and the offset of a piece of it (a DTensor's shard; () for a scalar)
_SHARE = re.compile(r"^rank-(\d+)$")


def pieces(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """The pieces this rank would write, as DCP plans them (``[name, offset]``: a DTensor's local shard, or a
    whole tensor at offset 0): plain data, to gather."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(tensors, is_coordinator=True)
    return [[item.index.fqn, list(item.index.offset or ())] for item in planner.create_local_plan().items]


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


def write(tensors: dict[str, torch.Tensor], target: Path, mine: set[Piece] | None, what: str) -> None:
    """Write the flat name -> tensor dict into ``target`` (``mine``: only those pieces; all when None)."""
    writer = FileSystemWriter(str(target), single_file_per_rank=True, sync_files=True)
    with _quiet(), _unwrapped(what):
        dcp.save(tensors, storage_writer=writer, planner=None if mine is None else _Only(mine), no_dist=True)


def read(tensors: dict[str, torch.Tensor], folder: Path, what: str) -> None:
    """Fill ``tensors`` in place from the checkpoint ``folder``: DCP reads the pieces this rank needs."""
    with _quiet(), _unwrapped(what):
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
