"""The ``torch.distributed`` point-to-point transport: gloo on CPU, NCCL on GPU.

Point-to-point goes to explicit group ranks, mapped to global ranks (the
pipeline group is never assumed to be WORLD). Every message has its own tag
(pipeline, direction, stage, micro-batch), so gloo matches messages by name
rather than by posting order, and a step abandoned after an error cannot feed
another pipeline. On NCCL a batch is one ``batch_isend_irecv`` group, and
eager ops go over a gloo side group on CPU, because a receive posted late in
its own group could deadlock the stream. NCCL waits only order streams, and a
step ends by polling a CUDA event; gloo waits run on helper threads
(:mod:`.waits`). Sends whose value the peer has already used
(:meth:`TorchTransport.release`) are complete, so they are waited on directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ..collectives import all_reduce_async
from ..faults.board import ErrorBoard
from ..faults.waits import Waits, Watch
from ..groups import GROUPED_BACKENDS, backend_of, side_group
from .protocol import TAG_BITS, Op, TransportSpec

T = TypeVar("T")


class TorchTransport:
    """Point-to-point, the error board and deadline-aware waits for one pipeline on one process group."""

    def __init__(self, spec: TransportSpec) -> None:
        group = spec.group
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.me = spec.label or f"rank {self.rank}"
        self._global = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.grouped = backend_of(group) in GROUPED_BACKENDS
        self._stream_waits = backend_of(group) == "nccl"  # a wait orders streams, the CPU goes on
        self._tag_base = (spec.pipeline_id % 1024) << TAG_BITS
        self.timeout = spec.timeout
        self.board = ErrorBoard(spec.name if spec.board is None else spec.board, spec.store, spec.timeout, self.me)
        self.waits = Waits(self.board, spec.timeout, self.me)
        side = side_group(group, lambda works, what: self.waits.wait(works, what), spec.timeout)
        self._eager_group = group if side is None else side
        self._sends: dict[int, Any] = {}  # id -> work, until finished or released
        self._eager_sends: list[Any] = []
        self._send_peer: dict[int, int] = {}  # id(work) -> the group rank it sends to (for failure messages)

    @property
    def failure(self) -> str | None:
        return self.board.failure

    @property
    def waiting(self) -> str:
        return self.waits.waiting

    def reset_waiting(self) -> None:
        """A step starts: what the last one waited for is no longer news (see engine.forensics)."""
        self.waits.waiting = ""

    @staticmethod
    def check_tag(tag: int) -> None:
        if not 0 <= tag < 1 << TAG_BITS:
            raise ValueError(f"message tag {tag} does not fit in {TAG_BITS} bits: too many stages x micro-batches")

    def fail(self, message: str) -> str:
        return self.board.fail(message)

    def check(self) -> None:
        self.board.check()

    def _live(self) -> None:
        if self.board.failure is not None:
            raise PipelineError(self.board.failure)

    # ---- posting -------------------------------------------------------
    def post(self, ops: Sequence[Op]) -> list[list[Any]]:
        """Post one schedule batch; returns, per op, the works that complete it.

        On NCCL the batch is one group whose works complete all of it, so every
        op gets them all; on gloo each op has its own. Sends are also kept for
        :meth:`finish_sends`.
        """
        self._live()
        if not ops:
            return []
        if not self.grouped:
            works = self._post_each(ops, self.group)
            self._keep(works, ops)
            return [[w] for w in works]
        p2p = [
            dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, g, self.group, self._tag_base + op.tag)
            for op, g in zip(ops, (self._global[op.peer] for op in ops))
        ]
        works = [w for w in dist.batch_isend_irecv(p2p) if w is not None]
        if len(works) == len(ops):  # a backend that does not coalesce: one work per op
            self._keep(works, ops)
            return [[w] for w in works]
        if any(op.send for op in ops):
            self._sends.update((id(w), w) for w in works)
        return [works for _ in ops]

    def _keep(self, works: Sequence[Any], ops: Sequence[Op]) -> None:
        for w, op in zip(works, ops):
            if op.send:
                self._sends[id(w)] = w
                self._send_peer[id(w)] = op.peer

    def post_eager(self, ops: Sequence[Op]) -> list[Any]:
        """Post ops one by one on gloo (the side group next to NCCL); tensors must live where gloo can read."""
        self._live()
        works = self._post_each(ops, self._eager_group)
        self._eager_sends.extend(w for w, op in zip(works, ops) if op.send)
        self._send_peer.update((id(w), op.peer) for w, op in zip(works, ops) if op.send)
        return works

    def _post_each(self, ops: Sequence[Op], group: Any) -> list[Any]:
        return [
            (dist.isend if op.send else dist.irecv)(op.tensor, self._global[op.peer], group, self._tag_base + op.tag)
            for op in ops
        ]

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Send ``tensor`` from group rank ``src`` to every rank (in place), within the deadline."""
        self._live()
        work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
        self.wait([work], what)

    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None:
        """Reduce ``tensor`` in place over the group (``"sum"`` or ``"max"``), within the deadline."""
        self._live()
        self.wait([all_reduce_async(tensor, self.group, op)], what)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """A blocking call that cannot be made asynchronous (process-group creation), within the deadline.

        It runs on a helper thread while this one watches the error board and the clock, as :meth:`wait` does.
        """
        self._live()
        return self.waits.call(fn, what)

    def warm_up(self) -> None:
        """On NCCL, the first call in a group must involve all its ranks: make it a collective, here."""
        if self._stream_waits:
            dist.all_reduce(torch.zeros(1, device="cuda"), group=self.group)

    # ---- waiting -------------------------------------------------------
    def watch(self, works: Sequence[Any]) -> Watch | None:
        """Start waiting for ``works`` on a helper thread; pass the result to :meth:`wait` (None: nothing to watch)."""
        if not works or self.board.failure is not None or self._stream_waits:
            return None
        return self.waits.watch(works)

    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None:
        """Block until ``works`` complete, raising :class:`PipelineError` on any rank's failure or the deadline."""
        if not works:
            return
        self._live()
        if self._stream_waits and not eager:
            self.waits.waiting = what
            for w in works:
                w.wait()
            return
        self.waits.wait(works, what, watch)

    def release(self, works: Sequence[Any], what: str) -> None:
        """Wait for sends known to be done (their value was used) so their buffers are freed before the step ends.

        The peer has used the value, so each send has completed or is about to (its I/O thread marks it done):
        a direct wait cannot block for long, and skips the helper's two wake-ups.
        """
        mine = [self._sends.pop(id(w)) for w in works if id(w) in self._sends]
        for w in mine:
            self._send_peer.pop(id(w), None)
        if self._stream_waits:
            self.wait(mine, what)
            return
        try:
            for w in mine:
                w.wait()
        except Exception as err:
            raise PipelineError(self.fail(f"{self.me}: {what} failed: {err}")) from err

    def finish_sends(self) -> None:
        """Wait for every send posted so far: after this their buffers may be freed."""
        sends, self._sends = list(self._sends.values()), {}
        for peer, works in self._by_peer(sends):
            self.wait(works, f"its sends to {peer} to complete")
        sends, self._eager_sends = self._eager_sends, []
        for peer, works in self._by_peer(sends):
            self.wait(works, f"its sends to {peer} to complete", eager=True)
        self._send_peer = {}

    def _by_peer(self, works: Sequence[Any]) -> list[tuple[str, list[Any]]]:
        """Sends grouped by the rank they go to, so that a failed one names its peer (a dead rank, usually)."""
        out: dict[str, list[Any]] = {}
        for w in works:
            peer = self._send_peer.get(id(w))
            out.setdefault("its peers" if peer is None else f"rank {peer}", []).append(w)
        return list(out.items())

    def synchronize(self, device: torch.device) -> None:
        """On CUDA, wait for queued kernels and transfers while watching the error board."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        started = time.perf_counter()
        while not event.query():
            self.waits.check_deadline(started, "the GPU to finish the step")
            time.sleep(0.0002)

    # ---- lifecycle -----------------------------------------------------
    def drop_groups(self) -> None:
        """Stop the helpers and forget the process groups, so that they can be destroyed (the pipeline is done).

        After a failure the groups are kept: a collective may still be stuck in
        them, and destroying a gloo group waits for its collectives.
        """
        self.close()
        if self.board.failure is None:
            self.group = self._eager_group = None
            self._sends, self._eager_sends = {}, []

    def close(self) -> None:
        """Stop the helper threads (see :meth:`.waits.Waits.close`)."""
        self.waits.close()
