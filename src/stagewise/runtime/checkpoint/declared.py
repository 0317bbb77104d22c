"""The state a pipeline declares: what checkpoints, snapshots, resumes and re-layouts read and restore.

A :class:`~stagewise.Pipeline` is an ``nn.Module`` whose ``state_dict()`` holds this rank's tensors under the
one-process model's names; beside them it declares, through :class:`PipelineState`, everything else a copy
of its state needs (torchtitan's ``Stateful`` is the precedent: a declared surface, not attributes read by
guess): where its ranks stand (the layout), the tied modules held only for a later use, its own optimizers,
its progress (:class:`Progress`) and the other places its state may be resumed from (:class:`StateSource`).

The rooms that read a pipeline's state (:mod:`.state`, :mod:`..elastic`, the re-layout) ask this protocol
and nothing else; mypy checks that the Pipeline and the HetPipe implement it (the last lines of ``pipeline.py``
and ``hetpipe.py``: a HetPipe's members are its virtual worker's pipeline's, :mod:`.through`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from ...schedules import is_asynchronous

if TYPE_CHECKING:
    from ...ir import Schedule
    from ...parallel import ParallelConfig
    from ..comm.transport.protocol import Transport


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` restored, and what it read about the run that saved it.

    ``extra``: the ``extra=`` dict given to :func:`save` (e.g. the data position).
    ``layout``: how the model was laid out (world size, pipeline ranks, schedule,
    placement, layer ranges, parallel degrees). ``rng_restored``: the RNG states
    are per rank, so they are restored only when the number of ranks is the same.
    ``reason``: why this folder was loaded (the one named, or the newest under a root).
    """

    path: Path
    step: int
    extra: Any
    layout: dict[str, Any]
    versions: dict[str, str]
    optimizer_restored: bool
    scheduler_restored: bool
    rng_restored: bool
    reason: str = ""
    scheduler_saved: bool = False  # the checkpoint holds an LR scheduler's state (restored or not)
    optimizer_saved: bool = False  # the checkpoint holds optimizer state (restored or not)


@dataclass(frozen=True)
class Progress:
    """How far training went, the same on every rank: what a resume or a re-layout carries over unchanged.

    ``train_steps``: mini-batches trained (the step of the dropout masks' seeds); ``dropout_seed``;
    ``merged_steps``: train steps inside ``no_sync()`` whose gradients are not yet reduced (a state that
    cannot be copied: gradients are not part of it); ``asynchronous``: the schedule steps each stage at its
    own STEPs, in windows that drain the pipeline at their end (between two windows nothing is in flight).
    """

    train_steps: int
    dropout_seed: int
    merged_steps: int
    asynchronous: bool


class Mesh(Protocol):
    """The parallel degrees a pipeline with ``parallel=`` runs under (its ``hybrid``)."""

    @property
    def config(self) -> ParallelConfig: ...


class TiedGroups(Protocol):
    """The tied modules' gradient sums (a pipeline's ``tied``): their process groups, by tied key."""

    groups: dict[str, Any]


@runtime_checkable
class PipelineState(Protocol):
    """What a pipeline declares of its state (see the module docstring); it is also an ``nn.Module`` whose
    ``state_dict()`` names its tensors as the one-process model does."""

    schedule: Schedule  # the layout: ranks, placement, micro-batches, virtual stages
    layer_ranges: list[range]  # the layers of each stage, in the one-process model's numbering
    device: Any
    transport: Transport  # the pipeline group and the guard every wait goes through
    optimizers: dict[int, torch.optim.Optimizer]  # its own, one per stage (``optimizer=factory``), or empty
    options: Any  # the options it was built with (a re-layout builds the next layout from the user's own)
    frontend: Any  # the way in it was built through (a re-layout builds the next layout through it again)

    @property
    def tied(self) -> TiedGroups:
        """The tied modules' sums, whose process groups a re-layout lets go."""
        ...

    train_steps: int  # mini-batches trained: the step of the dropout masks' seeds (set by a restore)
    dropout_seed: int  # (set by a restore)
    schedulers: dict[int, Any]  # lr_scheduler=: one per local stage's optimizer, stepped in lockstep (or empty)
    # snapshot=: its Snapshotter (elastic's, a floor above: typed there), which a re-layout re-points, or None
    snapshots: Any
    replanned_cut: list[int] | None  # the layers per stage a Replanner set (recorded so that a resume takes it)

    @property
    def local_stages(self) -> tuple[int, ...]:
        """The stages this process holds, in the schedule's numbering (which ranks hold what)."""
        ...

    @property
    def hybrid(self) -> Mesh | None:
        """The pp x dp x sharding x tp degrees (None: pipeline parallelism alone)."""
        ...

    @property
    def merged_steps(self) -> int:
        """Train steps under ``no_sync()`` whose gradients are not yet reduced (0 outside a gradient merge)."""
        ...

    @property
    def tied_copies(self) -> dict[str, nn.Module]:
        """Tied modules held only for a later use, by their first use's one-process name (not in
        ``state_dict()``: saved where the first use is, loaded into every holder)."""
        ...

    def state_sources(self) -> list[StateSource]:
        """Where else than the disk its state may be resumed from (the peers' snapshots, ``snapshot=``)."""
        ...


@dataclass(frozen=True)
class Offer:
    """The newest whole state a source holds: its step, what the source needs to restore it, and the membership
    generation that trained it (what its snapshot header or checkpoint record names)."""

    step: int
    detail: Any = None
    generation: int = 0


class StateSource(Protocol):
    """One place a resume may take the whole state from (the disk's checkpoints, the peers' snapshots).

    :func:`.resume.resume` asks each for its :meth:`newest`, a collective over the same ranks, and chooses in
    one place: the newest step, a tie going to the source listed last (memory before disk).
    """

    def newest(self, ranks: Any) -> Offer | None:
        """The newest whole state this source holds (the same answer on every rank), or None."""
        ...

    def restore(self, offer: Offer, floor: int) -> CheckpointInfo | None:
        """Load ``offer`` (a collective); None when it turned out unusable and nothing newer than ``floor``
        (the next source's step) is left here, so that the next source is tried. Nothing is written then."""
        ...

    def said(self, offer: Offer) -> str:
        """Where the state came from, as the resume's one line ends (``from peer snapshots``)."""
        ...

    def resumed(self, step: int, line: str) -> None:
        """The resume restored step ``step`` (from this source or another); ``line`` is what it says of it (rank 0
        logs it; a source may have other ranks say it too, as the peers' snapshots do on every machine)."""
        ...


def progress_of(pipe: PipelineState) -> Progress:
    """The pipeline's progress, as a value."""
    asynchronous = is_asynchronous(pipe.schedule)
    return Progress(int(pipe.train_steps), int(pipe.dropout_seed), int(pipe.merged_steps), asynchronous)


def restore_progress(pipe: PipelineState, progress: Progress) -> None:
    """Set the steps trained and the dropout seed (a gradient merge is never carried over: it is refused)."""
    pipe.train_steps, pipe.dropout_seed = progress.train_steps, progress.dropout_seed
