"""One rank's compute order, written action by action as integer columns (for the V schedules' generators).

The paper-style orders of zb-v and dualpipe-v are phases of "the next forward of this stage, the next input
gradient of that one"; :class:`RankOrder` numbers each (kind, stage)'s micro-batches for the generator, and
keeps the order as three integer columns, which :class:`~stagewise.ir.columns.ActionRows` turns into actions
only when asked (a V at 128 ranks x 1024 micro-batches has ~0.8 M compute actions).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..ir import F as _F
from ..ir import I as _I
from ..ir import W as _W


class RankOrder:
    """A rank's order under construction; micro-batches >= ``m`` are counted but left out.

    Leaving them out lets a generator follow a template made for more micro-batches than there are
    (the ZB-V warm-up needs 2p-1): what remains keeps the template's relative order.
    """

    def __init__(self, m: int) -> None:
        self.m = m
        self.kind: list[int] = []
        self.stage: list[int] = []
        self.mb: list[int] = []
        self._next: dict[tuple[int, int], int] = {}

    def add(self, kind: int, stage: int, mb: int | None = None) -> int:
        """Append ``kind`` on ``stage`` for ``mb`` (default: that (kind, stage)'s next micro-batch); return it."""
        if mb is None:
            mb = self._next.get((kind, stage), 0)
            self._next[kind, stage] = mb + 1
        if mb < self.m:
            self.kind.append(kind)
            self.stage.append(stage)
            self.mb.append(mb)
        return mb

    def forwards(self, stage: int, count: int) -> None:
        for _ in range(count):
            self.add(_F, stage)

    def count(self, kind: int, stage: int) -> int:
        """How many of ``kind`` on ``stage`` were numbered so far, left-out ones included."""
        return self._next.get((kind, stage), 0)

    def trail_weights(self, lag: int) -> None:
        """After the rank's last forward, let each W trail its input gradient by ``lag`` input gradients.

        The I passes keep their order and go first; W passes (oldest I first) follow one per I once more
        than ``lag`` are owed, the rest at the end. This is ZB-H1's rule for the drain: W work that would
        sit between two input gradients on their way back to rank 0 moves out of their way.
        """
        last_f = max((j for j, k in enumerate(self.kind) if k == _F), default=-1)
        head = list(zip(self.kind[: last_f + 1], self.stage[: last_f + 1], self.mb[: last_f + 1], strict=True))
        tail = list(zip(self.kind[last_f + 1 :], self.stage[last_f + 1 :], self.mb[last_f + 1 :], strict=True))
        weighed = {(s, mb) for k, s, mb in head if k == _W}
        owed = deque((s, mb) for k, s, mb in head if k == _I and (s, mb) not in weighed)
        order = head
        for k, s, mb in tail:
            if k != _I:
                continue
            order.append((k, s, mb))
            owed.append((s, mb))
            if len(owed) > lag:
                order.append((_W, *owed.popleft()))
        order += [(_W, s, mb) for s, mb in owed]
        self.kind, self.stage, self.mb = (list(col) for col in zip(*order, strict=True)) if order else ([], [], [])

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.kind, np.int64), np.asarray(self.stage, np.int64), np.asarray(self.mb, np.int64))
