"""What a model made of parts declares to be saved and loaded: each part under its own folder, as a pipeline.

A :class:`~stagewise.HetPipe` is K virtual workers, each an ordinary Pipeline over its own ranks, plus the state
of the wave rule. A checkpoint of it is each worker's pipeline saved (and loaded) under ``ROOT/vwK`` by the
worker's ranks, with the rule's state beside it: :func:`.api.save`, :func:`.api.load` and :func:`.resume.resume`
ask a model for its part through this protocol, which HetPipe declares (it subclasses it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class SavedInParts(Protocol):
    """A model whose checkpoint is one part per group of ranks (HetPipe: one per virtual worker)."""

    def checkpoint_part(self, path: Path) -> tuple[Path, nn.Module, dict[str, Any]]:
        """This rank's part under ``path``: its folder, the pipeline saved there, the state saved beside it."""
        ...

    def restore_part(self, state: dict[str, Any]) -> None:
        """After this rank's part was loaded: take back the state :meth:`checkpoint_part` saved beside it."""
        ...
