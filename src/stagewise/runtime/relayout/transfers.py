"""Which tensor goes from which process to which in a re-layout: pure arithmetic on names (no torch).

Every process lists the names it holds under the old layout and the names it needs under the new one (the
one-process model's names: ``model/NAME``, ``optim/NAME/KEY``). A name a process needs and holds itself
stays (it is copied in place); any other comes from its owner, the lowest process holding it, so a
replicated tensor is read once per receiver and never from two senders. Every process walks the same sorted
list of moves, so the sends and receives are posted in one global order and pair up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    """``name`` sent by process ``src`` to process ``dst`` (global ranks)."""

    name: str
    src: int
    dst: int


@dataclass(frozen=True)
class Transfers:
    """The moves, the names each process keeps from itself, and what no process holds (refused)."""

    moves: tuple[Move, ...]
    kept: dict[int, tuple[str, ...]]
    missing: dict[int, tuple[str, ...]]


def plan_transfers(held: Sequence[Sequence[str]], needed: Sequence[Sequence[str]]) -> Transfers:
    """``held[r]`` / ``needed[r]``: the names process ``r`` holds now / needs after (one entry per process)."""
    if len(held) != len(needed):
        raise ValueError(f"held lists {len(held)} processes but needed lists {len(needed)}")
    owner: dict[str, int] = {}
    for r, names in enumerate(held):
        for name in names:
            owner.setdefault(name, r)
    moves: list[Move] = []
    kept: dict[int, tuple[str, ...]] = {}
    missing: dict[int, tuple[str, ...]] = {}
    for r, names in enumerate(needed):
        mine = set(held[r])
        kept[r] = tuple(sorted(n for n in set(names) if n in mine))
        missing[r] = tuple(sorted(n for n in set(names) if n not in owner))
        moves += [Move(n, owner[n], r) for n in set(names) if n not in mine and n in owner]
    moves.sort(key=lambda m: (m.name, m.dst))
    return Transfers(tuple(moves), kept, {r: m for r, m in missing.items() if m})


def bytes_moved(transfers: Transfers, sizes: dict[str, int]) -> int:
    """The bytes the moves carry (``sizes``: bytes per name)."""
    return sum(sizes[m.name] for m in transfers.moves)
