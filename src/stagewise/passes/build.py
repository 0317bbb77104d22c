"""A registered schedule, generated and lowered: what the runtime executes."""

from __future__ import annotations

from .._util import gc_paused
from ..ir import Schedule
from ..schedules import generate
from .lowering import lower


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    *,
    grad_sync: bool = True,
    optimizer_steps: bool = False,
) -> Schedule:
    """The complete, validated schedule ``name``: what the runtime executes.

    >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    >>> print(s.to_text())
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC
    rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1SYNC
    """
    with gc_paused():  # one collection after the build instead of one after each of its three steps
        schedule = generate(name, num_ranks, num_microbatches, virtual_stages)
        return lower(schedule, grad_sync=grad_sync, optimizer_steps=optimizer_steps)


def build_like(name: str, running: Schedule, refused: str = "") -> Schedule:
    """Schedule ``name`` at ``running``'s ranks and micro-batches (a re-plan's other schedules); ``refused``: what a
    schedule that cannot run there is refused with (its name, the ranks and micro-batches and why follow)."""
    try:
        return build_schedule(name, len(running.ranks), running.num_microbatches)
    except (KeyError, ValueError) as err:
        if not refused:
            raise
        raise ValueError(
            f"{refused}{name!r}, which cannot run at {len(running.ranks)} ranks and {running.num_microbatches} "
            f"micro-batches: {err}"
        ) from err
