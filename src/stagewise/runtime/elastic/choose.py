"""Which snapshot generation to resume from, and who reads which file: pure, alike on every rank.

Every rank holds the same inventory (the files each machine has, by header) and the same needs (what each
rank of the new layout must load: its model tensors, and the parameters its optimizers hold), so every rank
computes the same :class:`Choice` without a word more.

A *generation* is one snapshot of every rank, ``(lineage, step)``. It can be resumed from when every rank's
needs are covered by its files that are still somewhere, whatever the layout that wrote them: a tensor is a
tensor, whichever data-parallel replica saved it. The newest such generation wins (by step; the lineage
breaks ties). Each rank takes the files of its own machine first (read in place), then others' (sent by
the first rank of the machine holding them); when the layout is the one that saved, rank ``r`` takes the
file rank ``r`` wrote, whose generators' states it restores - if one of them is lost, no rank restores
its generators (the states are per rank: a mix would be neither run's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Copy:
    """A snapshot file on one machine: where (``machine``, ``path``, the ``holder`` rank that reads it for
    others) and its header's facts."""

    machine: str
    holder: int
    path: str
    lineage: str
    step: int
    owner: int
    world: int
    layout: Any
    names: frozenset[str]
    job: str = ""  # the job that wrote it (drawn at its first start, kept across its restarts)
    membership: int = 0  # the membership generation that trained it (its header's ``generation``)

    @property
    def generation(self) -> tuple[int, str]:
        return (self.step, self.lineage)


@dataclass(frozen=True)
class Need:
    """What rank ``rank`` (on ``machine``) must load: its model tensors and its optimizers' parameters."""

    rank: int
    machine: str
    names: frozenset[str]


@dataclass
class Choice:
    """The generation to resume from, each rank's files (in the order its tensors are taken from them), the
    transfers ``(holder, receiver, copy)`` in the one order every rank runs them, and whether the
    generators' states come back."""

    step: int
    lineage: str
    world: int
    layout: Any
    reads: dict[int, list[Copy]] = field(default_factory=dict)
    transfers: list[tuple[int, int, Copy]] = field(default_factory=list)
    rng: bool = False
    job: str = ""
    membership: int = 0  # the membership generation that trained it


def of_live_jobs(copies: Iterable[Copy], ended: dict[str, int]) -> tuple[list[Copy], dict[str, list[Copy]]]:
    """The copies whose job has not ended, and those of each job that ended cleanly (``ended``: job -> its last
    step, from every machine's markers): a finished job's snapshots are never resumed from."""
    kept: list[Copy] = []
    refused: dict[str, list[Copy]] = {}
    for c in copies:
        if c.job and c.job in ended:
            refused.setdefault(c.job, []).append(c)
        else:
            kept.append(c)
    return kept, refused


def choose(copies: Iterable[Copy], needs: Sequence[Need], layout: Any, refused: set[tuple[str, str]]) -> Choice | None:
    """The newest generation every rank's needs are covered by (``refused``: ``(machine, path)`` of files a read
    found damaged, left out), or None. ``layout``: this run's, to tell whether the generators come back."""
    by_generation: dict[tuple[int, str], list[Copy]] = {}
    for c in copies:
        if (c.machine, c.path) not in refused:
            by_generation.setdefault(c.generation, []).append(c)
    # the newest membership generation first (an older one's newer step is a branch the job gave up), then step
    newest = sorted(by_generation, key=lambda g: (max(c.membership for c in by_generation[g]), g), reverse=True)
    for generation in newest:
        found = _cover(by_generation[generation], needs, layout)
        if found is not None:
            return found
    return None


def _cover(files: list[Copy], needs: Sequence[Need], layout: Any) -> Choice | None:
    first = files[0]
    same = first.world == len(needs) and first.layout == layout
    owners = {c.owner for c in files}
    choice = Choice(first.step, first.lineage, first.world, first.layout, job=first.job, membership=first.membership)
    choice.rng = same and all(n.rank in owners for n in needs)
    for need in needs:
        ordered = _ordered(files, need.machine)
        start = [next(c for c in ordered if c.owner == need.rank)] if choice.rng else []
        taken = _greedy(start, ordered, need.names)
        if taken is None:
            return None
        choice.reads[need.rank] = taken
    for need in needs:
        for c in choice.reads[need.rank]:
            if c.machine != need.machine:
                choice.transfers.append((c.holder, need.rank, c))
    choice.transfers.sort(key=lambda t: (t[0], t[1], t[2].machine, t[2].path))
    return choice


def _ordered(files: list[Copy], machine: str) -> list[Copy]:
    """This machine's files first (no transfer), then the others', each by owner."""
    return sorted(files, key=lambda c: (c.machine != machine, c.owner, c.machine, c.path))


def _greedy(start: list[Copy], files: list[Copy], names: frozenset[str]) -> list[Copy] | None:
    """Files covering ``names``, ``start`` first, then each file that brings a name still missing; None if some
    name is in none of them."""
    taken = list(start)
    missing = set(names) - set().union(*(c.names for c in taken))
    for c in files:
        if not missing:
            break
        if c not in taken and missing & c.names:
            taken.append(c)
            missing -= c.names
    return taken if not missing else None
