"""What a snapshot takes of a rank, and on which thread (:mod:`.snapshots` calls both halves).

:func:`take`, on the step's thread at the end of a train step: what the next step changes before its optimizer
step - the generators' states, the buffers (copied: a forward changes BatchNorm's statistics), the data
position, the optimizers' groups (their hyper-parameters: a scheduler or the user sets them between steps; their
parameters and each one's state entries: the user may add a group or load a state) - and references to the
tensors. :func:`complete`, first thing on the helper thread: the names and JSON of the optimizers' state, and
every live tensor's version counter, which nothing changes until the next optimizer step, and that step waits
for the helper's copy (``Capture.copied``). Naming and encoding the optimizers' state off the step's thread
keeps the step's own share of a snapshot to what cannot wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint import state
from .snapshot_file import versions


@dataclass
class Capture:
    """One snapshot on its way: the tensors (references until copied), where each goes, the header; the
    optimizers' groups as taken, whose state :func:`complete` adds, and the live model tensors."""

    step: int
    tensors: dict[str, torch.Tensor]
    header: dict[str, Any]
    optimizers: state.OptimizerTaken = field(default_factory=list)
    live: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict[str, Any] = field(default_factory=dict)
    total: int = 0
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_done: Any = None  # a CUDA event on the copy stream, when some tensor is on a GPU


@dataclass(frozen=True)
class Mark:
    """The live state at a snapshot's capture: each tensor's version counter, and the buffers' values."""

    versions: dict[str, int]
    copies: dict[str, torch.Tensor]


def take(snap: Any, trained: int | None) -> Capture:
    """The step thread's half for ``snap`` (a :class:`.snapshots.Snapshotter`; ``trained``: the mini-batches
    trained, this step's included)."""
    root = snap.root
    tensors, live = {}, {}
    for name, t in state.saved_tensors(root, keep_vars=True).items():  # (parameters told apart, no 2nd walk)
        live[state.MODEL + name] = view = t.detach()
        tensors[state.MODEL + name] = view if isinstance(t, nn.Parameter) else view.clone()  # (buffers change)
    names, layout = snap.fixed()
    optimizers = state.optimizer_taken(state.optimizers_of(root, None), names)
    extra = snap.config.extra() if snap.config.extra is not None else None
    header = {
        "run": snap.run,
        "job": snap.job,
        "lineage": snap.lineage,
        "step": snap.step,
        "owner": snap.rank,
        "world": snap.world,
        "layout": layout,
        "dropout": state.dropout_of(root, trained),
        "scheduler": state.scheduler_state(root),  # lr_scheduler=: a recovery goes on where the schedule was
        "optimizer": None,  # (complete)
        "rng": state.rng_taken(),  # (encoded on the helper: .snapshots)
        "extra": state.encode(extra, "Snapshots.extra"),
    }
    capture = Capture(snap.step, tensors, header, optimizers, live)
    if any(t.is_cuda for t in tensors.values()):
        ready = torch.cuda.Event()
        ready.record()  # the step's work queued so far, the optimizer's last update among it
        capture.cuda_done = ready
    return capture


def complete(capture: Capture, marks: dict[int, Mark]) -> None:
    """The helper's half, before the bytes are copied: the optimizers' state tensors into the capture, and its
    :class:`Mark` into ``marks`` (the two newest kept: a recovery takes a live tensor for this step's value only
    while it is unchanged, :mod:`..relayout.sources`; BatchNorm's forward writes its running statistics without
    counting a version: they are compared)."""
    live, tensors = capture.live, capture.tensors
    optim, capture.header["optimizer"] = state.optimizer_state(capture.optimizers)
    copies = {n: t for n, t in tensors.items() if n in live and t is not live[n]}
    tensors.update(optim)
    marks[capture.step] = Mark(versions({**live, **optim}), copies)
    for old in sorted(marks)[:-2]:
        del marks[old]
