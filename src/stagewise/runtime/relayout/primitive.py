"""The one re-layout primitive under ``pipe.relayout`` (:mod:`.call`) and a recovery's take-over (:mod:`.takeover`):
the new stages take every tensor from its source (its own process's live tensor: aliased; another process's
live one; else a snapshot file a process listed) through the one listing (:mod:`.listing`), the one move
(:func:`.fill.post_moves`) and the one fill (:func:`.fill.fill`).

The old state comes as a :class:`.takeover.Held` in both cases: ``pipe.relayout`` holds its own pipeline, every
tensor clean (its value is the current step's); a take-over holds what a survivor kept across the failed
generation, of which only the names still holding the committed snapshot's value are given live (``clean``).
What the callers keep apart: the agreement (a re-layout's request digest; a take-over's committed step), the
progress they restore, and the commit point's place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import state, storage
from .fill import fill, post_moves
from .listing import Listing, exchange
from .snapfiles import Files
from .sources import PARAM


@dataclass
class Held:
    """What a process holds of the old state: its tensors by name (no groups, no threads), their descriptions,
    its optimizers' metadata, and per step (``str(step)``) the names still holding that step's value
    (``model/NAME``, ``param:NAME``): a take-over's survivor (:func:`.takeover.hold`: per snapshot captured), a
    re-layout's own pipeline (:func:`.takeover.hold_whole`: every name, at the current step)."""

    tensors: dict[str, torch.Tensor]
    described: dict[str, Any]
    optimizer: dict[str, Any]
    live: dict[str, list[str]]
    generation: int = 0  # the membership generation that trained them


@dataclass(frozen=True)
class Relaid:
    """What the primitive did on this process: the listing (every process's row, the bytes moved) and how
    many of its tensors it kept (aliased), received, and read from a file for itself."""

    listing: Listing
    kept: int
    received: int
    read: int


def relay(
    held: Held | None,
    step: int,
    new: nn.Module | None,
    ranks: storage.Ranks,
    row: dict[str, Any],
    files: Files | None = None,
    lap: Callable[[str], Any] = lambda part: None,
) -> Relaid:
    """Fill ``new`` (None: this process builds nothing, it only gives) from every source. ``held``: what this
    process holds of the old state (None: nothing), of which only the names clean at ``step`` are given live;
    ``files``: this process's snapshot files (None alike everywhere: live owners only); ``row``: what every
    process learns of this one's new stages; ``lap(part)``: told when the move is done (before the fill)."""
    tensors: Mapping[str, torch.Tensor] = {}
    optimizer: Mapping[str, Any] = {"params": {}, "state": {}}
    if held is not None:
        tensors, optimizer = _clean(held.tensors, held.optimizer, set(held.live.get(str(step), ())))
    listing = exchange(tensors, optimizer, new, ranks, row, files)
    me = ranks.rank
    guard = ranks.guard
    assert guard is not None
    moves = ((m.name, m.src, m.dst, listing.source(m.name, m.dst, tensors)) for m in listing.transfers.moves)
    got = post_moves(moves, me, listing.targets, listing.described.__getitem__, ranks.group, guard.wait)
    lap("move")
    kept = {n: tensors[n] for n in listing.transfers.kept[me]}
    if new is not None:
        fill(new, listing.targets, {**kept, **listing.read, **got}, listing.record, kept)
    return Relaid(listing, len(kept), len(got), len(listing.read))


def _clean(
    tensors: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any], clean: set[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Only the clean names: the model tensors named, and the units (a parameter's optimizer metadata and state
    tensors) of the ``param:`` names."""
    units = {n[len(PARAM) :] for n in clean if n.startswith(PARAM)}
    out = {n: t for n, t in tensors.items() if n in clean}
    out.update({n: t for n, t in tensors.items() if n.startswith(state.OPTIM) and _unit(n) in units})
    meta = {
        "params": {p: v for p, v in optimizer["params"].items() if p in units},
        "state": {p: v for p, v in optimizer["state"].items() if p in units},
    }
    return out, meta


def _unit(name: str) -> str:
    """The parameter an optimizer state tensor (``optim/PARAM/KEY``) belongs to."""
    return name[len(state.OPTIM) : name.rindex("/")]
