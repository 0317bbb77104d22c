"""The ``torch.distributed`` point-to-point transport: gloo on CPU, NCCL on GPU.

Point-to-point goes to explicit group ranks under the pipeline's own tags
(:mod:`.p2p`). On NCCL a batch is one ``batch_isend_irecv`` group, and eager
ops go over a gloo side group on CPU, because a receive posted late in its own
group could deadlock the stream. NCCL waits only order streams, and a step
ends by polling a CUDA event; gloo waits run on the guard's helper threads
(:mod:`..faults.guard`). Sends whose value the peer has already used
(:meth:`TorchTransport.release`) are complete, so they are waited on directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...errors import PipelineError
from ..collectives import all_reduce_async
from ..faults.guard import Guard
from ..faults.waiters import Watch
from ..groups import GROUPED_BACKENDS, backend_of, side_group
from .p2p import Addresses, Eager, Sends
from .protocol import Op, TransportSpec, guard_for


class TorchTransport:
    """Point-to-point for one pipeline on one process group; its waits are its guard's."""

    def __init__(self, spec: TransportSpec, guard: Guard | None = None) -> None:
        group = spec.group
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.grouped = backend_of(group) in GROUPED_BACKENDS
        self._stream_waits = backend_of(group) == "nccl"  # a wait orders streams, the CPU goes on
        self.guard = guard if guard is not None else guard_for(spec)
        self._addresses = Addresses(group, spec.pipeline_id)
        side = side_group(group, lambda works, what: self.guard.wait(works, what, blocking=True), spec.timeout)
        self.eager = Eager(group if side is None else side, self._addresses, self.guard)
        self._sends = Sends()  # batched sends, until finished or released

    # ---- posting -------------------------------------------------------
    def post(self, ops: Sequence[Op]) -> list[list[Any]]:
        """Post one schedule batch; returns, per op, the works that complete it.

        On NCCL the batch is one group whose works complete all of it, so every
        op gets them all; on gloo each op has its own. Sends are also kept for
        :meth:`finish_sends`.
        """
        self.guard.live()
        if not ops:
            return []
        if not self.grouped:
            works = self._addresses.post_each(ops, self.group)
            self._keep(works, ops)
            return [[w] for w in works]
        works = [w for w in dist.batch_isend_irecv(self._addresses.p2p_ops(ops, self.group)) if w is not None]
        if len(works) == len(ops):  # a backend that does not coalesce: one work per op
            self._keep(works, ops)
            return [[w] for w in works]
        if any(op.send for op in ops):
            for w in works:
                self._sends.keep(w, None)
        return [works for _ in ops]

    def _keep(self, works: Sequence[Any], ops: Sequence[Op]) -> None:
        for w, op in zip(works, ops):
            if op.send:
                self._sends.keep(w, op.peer)

    def post_eager(self, ops: Sequence[Op]) -> list[Any]:
        """Post ops one by one on gloo (the side group next to NCCL); tensors must live where gloo can read."""
        return self.eager.post(ops)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Send ``tensor`` from group rank ``src`` to every rank (in place), within the deadline."""
        self.guard.live()
        work = dist.broadcast(tensor, group_src=src, group=self.group, async_op=True)
        self.guard.wait([work], what)

    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> None:
        """Reduce ``tensor`` in place over the group (``"sum"`` or ``"max"``), within the deadline."""
        self.guard.live()
        self.guard.wait([all_reduce_async(tensor, self.group, op)], what)

    def warm_up(self) -> None:
        """On NCCL, the first call in a group must involve all its ranks: make it a collective, here."""
        if self._stream_waits:
            dist.all_reduce(torch.zeros(1, device="cuda"), group=self.group)

    # ---- waiting -------------------------------------------------------
    def watch(self, works: Sequence[Any]) -> Watch | None:
        """Start waiting for ``works`` on a helper thread; pass the result to :meth:`wait` (None: nothing to watch)."""
        return self.guard.watch(works)

    def wait(self, works: Sequence[Any], what: str, *, eager: bool = False, watch: Watch | None = None) -> None:
        """Block until ``works`` complete, raising :class:`PipelineError` on any rank's failure or the deadline.

        ``eager``: works of :meth:`post_eager` (gloo, even next to NCCL: waited for on a helper thread)."""
        self.guard.wait(works, what, watch=watch, blocking=eager)

    def release(self, works: Sequence[Any], what: str) -> None:
        """Wait for sends known to be done (their value was used) so their buffers are freed before the step ends.

        The peer has used the value, so each send has completed or is about to (its I/O thread marks it done):
        a direct wait cannot block for long, and skips the helper's two wake-ups.
        """
        mine = self._sends.take(works)
        if self._stream_waits:
            self.guard.wait(mine, what)
            return
        try:
            for w in mine:
                w.wait()
        except Exception as err:
            raise PipelineError(self.guard.fail(f"{self.guard.me}: {what} failed: {err}")) from err

    def finish_sends(self) -> None:
        """Wait for every send posted so far: after this their buffers may be freed."""
        for peer, works in self._sends.take_all():
            self.guard.wait(works, f"its sends to {peer} to complete")
        self.eager.finish()

    def synchronize(self, device: torch.device) -> None:
        """On CUDA, wait for queued kernels and transfers while watching the error board."""
        self.guard.wait_gpu(device, "the GPU to finish the step")

    # ---- lifecycle -----------------------------------------------------
    def close(self) -> None:
        """Stop the guard's helper threads and let go of the process groups, so that they can be destroyed.

        After a failure the groups are kept: a collective may still be stuck in
        them, and destroying a gloo group waits for its collectives.
        """
        self.guard.close()
        if self.guard.failure is None:
            self.group = None
            self.eager.forget_group()
            self._sends.clear()
