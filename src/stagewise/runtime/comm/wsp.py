"""HetPipe's process groups and its parameter-server role as *delayed collectives* on torch.distributed.

Why delayed collectives rather than a parameter-server rank (or rpc): after
wave c every rank of every VW starts a non-blocking SUM all-reduce of its
update (its own stage's parameters, zeros elsewhere, in the one-process
model's order), so the sum is sum_v u_v^c: exactly what a parameter server
would have accumulated from the K pushes of clock c. A VW waits for the
reduction of clock c - D only just before wave c + 1 - which is the WSP bound
itself: the all-reduce cannot complete before every VW has started it, i.e.
finished wave c - D. The semantics are the same bounded staleness, but

* deterministic: the pulled weights depend on which clocks are in, never on
  the order pushes reached a server, so a one-process replay equals the run;
* no extra rank and no server bottleneck (HetPipe's PS is a known hot spot);
  the reduction is spread over all ranks and overlaps the next waves;
* nothing new to trust: collectives in the order every rank issues them, no
  rpc agent, no pickled messages.

Waits go through the pipeline's guard (its deadline and error board), so
a failure anywhere stops every VW instead of leaving one waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Wait = Callable[[Sequence[Any], str], None]


def world() -> tuple[int, int]:
    """This process's global rank and the world size."""
    return dist.get_rank(), dist.get_world_size()


def make_groups(workers: Sequence[Sequence[int]], timeout: float) -> tuple[Any, Any]:
    """(this rank's VW group, the group of every VW rank): every rank makes every group, in the same order; each
    within ``timeout``, stopped by a failure posted for the job (:func:`.coordinator.call_with_deadline`)."""
    from datetime import timedelta

    from .coordinator import call_with_deadline

    def group(ranks: list[int]) -> Any:
        make = lambda: dist.new_group(ranks, timeout=timedelta(seconds=timeout))  # noqa: E731
        return call_with_deadline(make, timeout, f"the process group of global ranks {ranks} (HetPipe)")

    mine = None
    rank = dist.get_rank()
    for ranks in workers:
        made = group(list(ranks))
        if rank in ranks:
            mine = made
    everyone = group(sorted(r for w in workers for r in w))
    return mine, everyone


class DelayedSum:
    """Sums started now and waited for later, in the order they were started (one per wave)."""

    def __init__(self, group: Any, wait: Wait) -> None:
        self.group = group
        self.wait = wait
        self.pending: list[tuple[int, torch.Tensor, Any]] = []  # (clock, buffer, work), oldest first

    def start(self, clock: int, buffer: torch.Tensor) -> None:
        """Start the SUM all-reduce of ``buffer`` (in place) for ``clock``."""
        work = dist.all_reduce(buffer, dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.pending.append((clock, buffer, work))

    def oldest(self) -> int | None:
        return self.pending[0][0] if self.pending else None

    def finish_oldest(self) -> tuple[int, torch.Tensor]:
        """Wait (deadline, error board) for the oldest sum; its clock and the summed buffer."""
        clock, buffer, work = self.pending.pop(0)
        self.wait([work], f"the updates of every virtual worker's wave {clock} (the WSP reduction)")
        return clock, buffer


def gather_records(obj: Any, group: Any, wait: Wait) -> list[Any]:
    """Every rank's JSON-able ``obj`` over ``group``, in group-rank order (deadline-bounded)."""
    from .collectives import gather_json

    return gather_json(obj, group, wait, "every rank's parameter names (HetPipe)")
