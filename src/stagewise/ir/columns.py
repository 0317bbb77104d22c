"""A schedule's actions as flat integer columns (kind, stage, micro-batch), and rows made from them on demand.

Why: the lowering, the validator's array path and the simulator all work on
every action's kind, stage and micro-batch as numbers, and a V schedule at 128
ranks x 1024 micro-batches has 1.8 M actions: making them as objects costs
~0.3 s, reading them back ~0.3 s per reader. So the two forms are one truth:

* a schedule built from actions (generators, CSV, hand-written) has its columns
  read from those actions once (:func:`columns`; a schedule is immutable, so
  they stay true);
* a schedule the lowering builds *is* its columns: its ``ranks`` is an
  :class:`ActionRows`, which makes rank r's action tuple from the columns the
  first time someone asks for it (a runtime rank asks for its own row only).

Either way the validator proves facts about the columns, and every action
that runs or is drawn is made from (or read into) those same columns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import index, itemgetter
from typing import Any, Protocol, overload

import numpy as np

from .actions import Action, Kind


class _Rows(Protocol):
    """What :func:`columns` reads of a :class:`~stagewise.ir.schedule.Schedule` (which imports this module)."""

    @property
    def ranks(self) -> Sequence[Sequence[Action]]: ...


#: kind codes: compute first (so "compute" is code < 4), then communication, then the per-stage kinds
KINDS = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP)
F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, SYNC, STEP = range(10)  # noqa: E741 - the paper's name for I
# by identity, as the scan compares kinds (a plain string "F" equals Kind.F but is no action kind)
_CODE_BY_ID = {id(k): c for c, k in enumerate(KINDS)}
_PER_STAGE_FLAGS = bytes(1 if c >= SYNC else 0 for c in range(256))
_PER_ACTION_FLAGS = bytes(0 if c >= SYNC else 1 for c in range(256))
_stage_of, _kind_of, _mb_of = itemgetter(0), itemgetter(1), itemgetter(2)


@dataclass(frozen=True, eq=False)
class Columns:
    """Every action of a schedule, rank after rank: ``kind`` (uint8 code in :data:`KINDS`), ``stage``,
    ``microbatch`` (-1 for SYNC / STEP), and ``base[r]``, the flat index of rank r's first action."""

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    base: np.ndarray

    @property
    def rank(self) -> np.ndarray:
        """The rank of each action."""
        return np.repeat(np.arange(self.base.size - 1, dtype=np.int64), np.diff(self.base))


class ActionRows(Sequence[tuple[Action, ...]]):
    """A schedule's per-rank action tuples, each made from the columns on first access, then kept.

    Behaves as the tuple of tuples it stands for: equal to it, same hash,
    pickled as it. Made by the lowering (after checking nothing in them needs
    an object: every kind a :class:`Kind`, every field an int) and by
    generators that compute an order as arrays (the V schedules).
    """

    __slots__ = ("columns", "_rows")

    def __init__(self, columns: Columns) -> None:
        self.columns = columns
        self._rows: list[tuple[Action, ...] | None] = [None] * (columns.base.size - 1)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, rank: int) -> tuple[Action, ...]: ...
    @overload
    def __getitem__(self, rank: slice) -> tuple[tuple[Action, ...], ...]: ...
    def __getitem__(self, rank: int | slice) -> tuple[Action, ...] | tuple[tuple[Action, ...], ...]:
        if isinstance(rank, slice):
            return tuple(self[r] for r in range(*rank.indices(len(self))))
        row = self._rows[rank]  # IndexError as a tuple raises it
        if row is None:
            r = rank % len(self._rows)
            row = self._rows[r] = _make_row(self.columns, r)
        return row

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return (self[r] for r in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ActionRows | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))

    def __repr__(self) -> str:
        return repr(tuple(self))


def _make_row(cols: Columns, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s actions, made in C (``tuple.__new__`` on zipped fields)."""
    a, b = int(cols.base[rank]), int(cols.base[rank + 1])
    mbs = cols.microbatch[a:b].tolist()
    kinds = cols.kind[a:b].tolist()
    mb_or_none = (None if k >= SYNC else i for k, i in zip(kinds, mbs, strict=True))
    fields = zip(cols.stage[a:b].tolist(), map(KINDS.__getitem__, kinds), mb_or_none, strict=True)
    return tuple(map(tuple.__new__, repeat(Action), fields))


def columns(schedule: _Rows) -> Columns | None:
    """The schedule's columns, or None when an action does not read as numbers.

    None means: a kind that is not a :class:`~stagewise.ir.actions.Kind` member, a
    stage or micro-batch that is not an integer (``2.5`` and ``"2"`` are refused,
    as ``operator.index`` refuses them), a per-action
    kind without a micro-batch, or a SYNC / STEP with one. Ranges are not
    checked here: that is the caller's business.
    """
    if isinstance(schedule.ranks, ActionRows):
        return schedule.ranks.columns
    if "_columns" not in schedule.__dict__:
        object.__setattr__(schedule, "_columns", _read(schedule))
    cached: Columns | None = schedule.__dict__["_columns"]
    return cached


def _read(schedule: _Rows) -> Columns | None:
    ranks = schedule.ranks
    flat = chain.from_iterable
    lens = np.fromiter(map(len, ranks), np.int64, len(ranks))
    base = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=base[1:])
    total = int(base[-1])
    try:
        kb = bytes(map(_CODE_BY_ID.__getitem__, map(id, map(_kind_of, flat(ranks)))))
    except KeyError:  # not a Kind member
        return None
    per_action = kb.translate(_PER_ACTION_FLAGS)
    n_actions = per_action.count(1)
    try:
        stage = np.fromiter(map(index, map(_stage_of, flat(ranks))), np.int64, total)
        mb_acts = np.fromiter(map(index, map(_mb_of, compress(flat(ranks), per_action))), np.int64, n_actions)
    except (TypeError, ValueError, OverflowError):  # a missing or non-integer field
        return None
    if n_actions != total and any(
        i is not None for i in map(_mb_of, compress(flat(ranks), kb.translate(_PER_STAGE_FLAGS)))
    ):
        return None
    kind = np.frombuffer(kb, np.uint8)
    if n_actions == total:
        mb = mb_acts
    else:
        mb = np.full(total, -1, np.int64)
        mb[np.frombuffer(per_action, np.uint8).astype(bool)] = mb_acts
    return Columns(kind=kind, stage=stage, microbatch=mb, base=base)


def in_range(cols: Columns, num_stages: int, num_microbatches: int) -> bool:
    """Every stage in 0..n-1 and every micro-batch of a per-action kind in 0..m-1."""
    mb = cols.microbatch[cols.kind < SYNC]
    stage = cols.stage
    return (not stage.size or (int(stage.min()) >= 0 and int(stage.max()) < num_stages)) and (
        not mb.size or (int(mb.min()) >= 0 and int(mb.max()) < num_microbatches)
    )


def insert_after_last(cols: Columns, placement: Sequence[int], code: int, after: Sequence[int]) -> Columns | None:
    """``cols`` with one action ``(s, code)`` right after the last action of stage s whose kind is in ``after``,
    for every stage s that has one; None if a stage is out of range or an action of a stage sits on another
    rank than ``placement`` says (the object pass handles that schedule).

    The column form of :func:`stagewise.passes.lowering.add_grad_sync`'s insertion, for a schedule that is columns
    already (a generator's or the lowering's): no rank's row is made.
    """
    n = len(placement)
    stage, kind = cols.stage, cols.kind
    if stage.size and (int(stage.min()) < 0 or int(stage.max()) >= n):
        return None
    rank = cols.rank
    if not np.array_equal(np.asarray(placement, np.int64)[stage], rank):
        return None
    hits = np.flatnonzero(np.isin(kind, np.asarray(after, np.uint8)))
    if not hits.size:
        return cols
    # the last hit of each stage: scanning the hits backwards, the first time each stage appears
    rev = hits[::-1]
    stages, first = np.unique(stage[rev], return_index=True)
    at = rev[first]  # flat index of each stage's last hit (one action, one stage: no two alike)
    order = np.argsort(at)
    at, stages = at[order], stages[order]
    where = at + 1
    out_kind = np.insert(kind, where, np.uint8(code))
    out_stage = np.insert(stage, where, stages)
    out_mb = np.insert(cols.microbatch, where, -1)
    added = np.bincount(rank[at], minlength=cols.base.size - 1)
    base = cols.base.copy()
    base[1:] += np.cumsum(added)
    return Columns(kind=out_kind, stage=out_stage, microbatch=out_mb, base=base)


def from_rows(rows: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Columns:
    """Columns from each rank's (kind codes, stages, micro-batches), for a generator that computes its orders
    as arrays."""
    lens = np.fromiter((len(kind) for kind, _, _ in rows), np.int64, len(rows))
    base = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lens, out=base[1:])
    kind, stage, mb = (np.concatenate([row[j] for row in rows]) if rows else np.zeros(0, np.int64) for j in range(3))
    return Columns(kind=kind.astype(np.uint8), stage=stage.astype(np.int64), microbatch=mb.astype(np.int64), base=base)
