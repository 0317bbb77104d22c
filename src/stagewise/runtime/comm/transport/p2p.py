"""torch.distributed point-to-point pieces that both transports post through.

* :class:`Addresses`: group ranks mapped to global ranks (the pipeline group is
  never assumed to be WORLD) and message tags to the pipeline's tags, so gloo
  matches messages by name rather than by posting order, and a step abandoned
  after an error cannot feed another pipeline;
* :class:`Sends`: sends posted and not yet waited for, each with the rank it
  goes to, so that a failed wait names the peer (a dead rank, usually);
* :class:`Eager`: ops posted one at a time on a gloo group, their sends kept
  until the step's end: what a value's first exchange (its shapes) and
  variable shapes travel by.

Why a file of its own: the shm transport moves the steady state through
shared memory but the eager ops through torch, exactly as the torch transport
does. Sharing these pieces lets each transport be composed of what it needs
(and its :class:`~..faults.guard.Guard`) rather than one transport wrapping
the other and re-exporting its interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..faults.guard import Guard
from .protocol import TAG_BITS, Op


class Addresses:
    """Where the ops of one pipeline go: group rank -> global rank, message tag -> the pipeline's tag."""

    def __init__(self, group: Any, pipeline_id: int) -> None:
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.tag_base = (pipeline_id % 1024) << TAG_BITS

    def post_each(self, ops: Sequence[Op], group: Any) -> list[Any]:
        """``isend`` / ``irecv`` each op on ``group``; one work per op."""
        return [
            (dist.isend if op.send else dist.irecv)(
                op.tensor, self.global_ranks[op.peer], group, self.tag_base + op.tag
            )
            for op in ops
        ]

    def p2p_ops(self, ops: Sequence[Op], group: Any) -> list[dist.P2POp]:
        """The ops for one ``batch_isend_irecv`` group on ``group``."""
        return [
            dist.P2POp(
                dist.isend if op.send else dist.irecv,
                op.tensor,
                self.global_ranks[op.peer],
                group,
                self.tag_base + op.tag,
            )
            for op in ops
        ]


class Sends:
    """Sends posted and not yet waited for, in posting order, each with the group rank it goes to (None: several)."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Any, int | None]] = {}  # id(work) -> (work, peer)

    def keep(self, work: Any, peer: int | None) -> None:
        self._kept[id(work)] = (work, peer)

    def take(self, works: Sequence[Any]) -> list[Any]:
        """Those of ``works`` that are kept here, forgotten."""
        return [self._kept.pop(id(w))[0] for w in works if id(w) in self._kept]

    def take_all(self) -> list[tuple[str, list[Any]]]:
        """Every kept send, forgotten, grouped by the rank it goes to: ``("rank 2", works)``."""
        kept, self._kept = self._kept, {}
        out: dict[str, list[Any]] = {}
        for work, peer in kept.values():
            out.setdefault("its peers" if peer is None else f"rank {peer}", []).append(work)
        return list(out.items())

    def clear(self) -> None:
        self._kept = {}


class Eager:
    """Ops posted one by one on a gloo ``group``; every wait is ``guard``'s, on a helper thread (gloo blocks)."""

    def __init__(self, group: Any, addresses: Addresses, guard: Guard) -> None:
        self.group = group
        self.addresses = addresses
        self.guard = guard
        self.sends = Sends()

    def post(self, ops: Sequence[Op]) -> list[Any]:
        """Post ``ops``, one work each; tensors must live where gloo can read them (the CPU)."""
        self.guard.live()
        works = self.addresses.post_each(ops, self.group)
        for w, op in zip(works, ops):
            if op.send:
                self.sends.keep(w, op.peer)
        return works

    def finish(self) -> None:
        """Wait for every send posted so far, rank by rank (a failed one names its peer)."""
        for peer, works in self.sends.take_all():
            self.guard.wait(works, f"its sends to {peer} to complete", blocking=True)

    def forget_group(self) -> None:
        """Let go of the group (the pipeline is done), and of the sends no one will wait for."""
        self.group = None
        self.sends.clear()
