"""A re-layout's listing in 64-bit keys (pure: no torch): who holds which tensor, who needs it, who sends it.

Every process must learn who owns each tensor it needs, and whom to send each tensor it owns; that takes every
process's listing. Sent as names (JSON), the listings grow with processes x tensors x name length and every
process holds all of them at once (measured: 5 x 15.9 KB on a 13 KB-per-process model, more than a retiring
process's whole state). Here a name travels as the first 8 bytes of its BLAKE2b digest, and an optimizer's
state as one key per parameter (a *unit*: its hyper-parameters and every state entry, moved together). Names,
shapes and optimizer metadata then go point to point, only between the pairs of processes a tensor moves between
(:mod:`.listing`), where the receiver checks each name it was sent against the one it asked for (a key shared by
two names is found there, not trusted).

A process's listing is four key lists: model tensors held, optimizer units held, model tensors needed, units
needed. :func:`plan` reads every process's and gives one process its part; the owner of a key is the lowest
process holding it (:func:`.sources.live_source`, the take-over's rule too: a replicated tensor is read once per
receiver). A key no process holds live falls back to a snapshot file a process listed (:class:`Filed`, in
:func:`.sources.nearest_first`'s order), which its lister reads and sends (itself when the receiver listed it);
only a model tensor found nowhere is lost (refused).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .sources import live_source, nearest_first

MODEL, UNIT = 0, 1  # the kinds of key: a model tensor, an optimizer unit (one parameter's state)
LISTS = 4  # held model tensors, held units, needed model tensors, needed units

Item = tuple[int, int]  # (kind, key)


def key(name: str) -> int:
    """The name's 64-bit key (signed, to travel in an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def keyed(names: Iterable[str], what: str) -> dict[int, str]:
    """key -> name for ``names``; two names of one process that share a key are refused (never seen: 2^-64)."""
    out: dict[int, str] = {}
    for name in names:
        other = out.setdefault(key(name), name)
        if other != name:
            raise ValueError(f"relayout: {what} {other!r} and {name!r} share a 64-bit key; rename one")
    return out


def pack(lists: Sequence[Iterable[int]]) -> list[int]:
    """``LISTS`` key lists as one flat list: their lengths, then each list sorted."""
    if len(lists) != LISTS:
        raise ValueError(f"pack takes {LISTS} key lists, got {len(lists)}")
    ordered = [sorted(keys) for keys in lists]
    return [len(keys) for keys in ordered] + [k for keys in ordered for k in keys]


def unpack(flat: Sequence[int]) -> list[list[int]]:
    """The inverse of :func:`pack`."""
    lengths, out, at = list(flat[:LISTS]), [], LISTS
    for n in lengths:
        out.append(list(flat[at : at + n]))
        at += n
    if at != len(flat):
        raise ValueError(f"a packed listing of {len(flat)} values whose lengths {lengths} say {at}")
    return out


@dataclass(frozen=True)
class Filed:
    """A snapshot file process ``holder`` listed (one of its machine's): where it is, whose it was, its items."""

    machine: str
    holder: int
    owner: int
    path: str
    items: frozenset[Item]


@dataclass(frozen=True)
class Plan:
    """One process's part: what it sends to each process, receives from each, keeps from itself, and the model
    tensors it needs that no source holds (refused; a unit no one holds is left fresh, as a load with
    ``strict=False``). ``read``: the items it takes for itself from a file it listed; ``filed``: the
    file (path) each item it reads comes from, by (receiver, item): to send (receiver another process) or its own
    (``read``)."""

    sends: dict[int, tuple[Item, ...]]
    receives: dict[int, tuple[Item, ...]]
    kept: tuple[Item, ...]
    lost: tuple[Item, ...]
    read: tuple[Item, ...] = ()
    filed: dict[tuple[int, Item], str] = field(default_factory=dict)


def plan(
    everyone: Sequence[Sequence[Sequence[int]]], rank: int, files: Sequence[Filed] = (), machines: Sequence[str] = ()
) -> Plan:
    """``everyone[r]``: process ``r``'s four key lists (see :func:`unpack`); the part of process ``rank``.
    ``files``: the snapshot files every process listed, the fallback of a key no process holds live;
    ``machines[r]``: process ``r``'s machine (needed with ``files``)."""
    if files and len(machines) != len(everyone):
        raise ValueError(f"plan: {len(everyone)} processes' key lists but {len(machines)} machines")
    held = [{(MODEL, k) for k in lists[0]} | {(UNIT, k) for k in lists[1]} for lists in everyone]
    needed = [{(MODEL, k) for k in lists[2]} | {(UNIT, k) for k in lists[3]} for lists in everyone]
    holders: dict[Item, list[int]] = {}
    for r, items in enumerate(held):
        for item in items:
            holders.setdefault(item, []).append(r)
    sends: dict[int, list[Item]] = {}
    receives: dict[int, list[Item]] = {}
    lost: list[Item] = []
    read: list[Item] = []
    filed: dict[tuple[int, Item], str] = {}
    for r, items in enumerate(needed):
        near = nearest_first(files, machines[r]) if files else []
        for item in sorted(items - held[r]):
            src, path = live_source(r, holders.get(item, ())), None
            if src is None:
                src, path = _from_file(near, item, r, machines)
            if src is None:
                lost += [item] if r == rank and item[0] == MODEL else []
                continue
            if path is not None and src == rank:
                filed[(r, item)] = path
            if src == rank == r:
                read.append(item)
            elif src == rank:
                sends.setdefault(r, []).append(item)
            elif r == rank:
                receives.setdefault(src, []).append(item)
    kept = tuple(sorted(needed[rank] & held[rank]))
    return Plan(_sorted(sends), _sorted(receives), kept, tuple(sorted(lost)), tuple(sorted(read)), filed)


def _from_file(near: Sequence[Filed], item: Item, r: int, machines: Sequence[str]) -> tuple[int | None, str | None]:
    """Who reads ``item`` for receiver ``r`` from a file, and which: the first of ``near`` holding it, read by
    the process that listed it (``r`` itself when it did), which sends it on: a process reads only the files it
    listed, since only their listing says what it may verify them against (None, None: no file holds it)."""
    found = next((f for f in near if item in f.items), None)
    if found is None:
        return None, None
    return found.holder, found.path


def _sorted(by_peer: Mapping[int, list[Item]]) -> dict[int, tuple[Item, ...]]:
    return {peer: tuple(sorted(items)) for peer, items in sorted(by_peer.items())}
