"""A live re-layout: train on 4 processes, go to 2 (two retire, holding nothing), come back to 4 with another
schedule, all in the same processes; the state moves exactly (see docs/guides/relayout.md).

    stagewise run -n 4 examples/relayout.py
    stagewise run -n 4 examples/relayout.py --timeline docs/relayout-timeline.png   # the steps and the calls

Every process reads the same global batch and passes its share (``pipe.local_batch``), so nothing about the
data changes when the stage-0 and last ranks do.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stagewise as sw
from stagewise.ir import Timeline

D, VOCAB, SEQ, BATCH = 32, 64, 16, 8
log = logging.getLogger("relayout")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


def layers() -> list[sw.Layer]:
    return [sw.Layer(nn.Embedding, VOCAB, D), *[sw.Layer(Block) for _ in range(6)], sw.Layer(nn.Linear, D, VOCAB)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def train(pipe: sw.Pipeline, steps: range, rank: int) -> None:
    for step in steps:
        loss = pipe.train_step(*pipe.local_batch(*batch(step)))
        if rank == 0:
            log.warning("step %d: loss %.4f", step, loss)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="steps between two re-layouts")
    parser.add_argument("--timeline", default=None, help="draw the steps around the re-layouts, and their parts, here")
    args = parser.parse_args()
    env = sw.init()
    opt = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731 (the pipeline's own: it moves along)
    pipe = sw.Pipeline(layers(), loss_fn=loss_fn, optimizer=opt, microbatches=4, seed=0)
    train(pipe, range(0, args.steps), env.rank)
    before = pipe.timeline(gather=True) if args.timeline else None  # (a collective: every process)
    half = list(range(max(1, env.world_size // 2)))
    shrink = pipe.relayout(half)  # every process calls it; the others now hold nothing
    if env.rank == 0:
        log.warning("now on %s: %s, %d bytes moved", shrink.members, shrink.seconds, shrink.bytes_moved)
    if env.rank in half:
        train(pipe, range(args.steps, 2 * args.steps), env.rank)
    grow = pipe.relayout(schedule="gpipe")  # all of them again, another schedule
    if env.rank == 0:
        log.warning("now on %s (%s): inputs at %s", grow.members, grow.schedule, grow.inputs_at)
    train(pipe, range(2 * args.steps, 3 * args.steps), env.rank)
    if before is not None:
        after = pipe.timeline(gather=True)
        parts: list[Any] = [None] * env.world_size  # each process's seconds per part of both calls
        torch.distributed.all_gather_object(parts, (shrink.seconds, grow.seconds))
        if env.rank == 0:
            draw(Path(args.timeline), before, [p[0] for p in parts], [p[1] for p in parts], after, len(half))


KIND_COLORS = {"F": "#4E79A7", "B": "#E15759"}  # (1F1B and GPipe have no I or W)
PART_COLORS = ["#76B7B2", "#EDC948", "#B07AA1", "#FF9DA7", "#9C755F", "#BAB0AC", "#4B4B4B"]


def draw(
    path: Path,
    before: Timeline,
    shrink: list[dict[str, float]],
    grow: list[dict[str, float]],
    after: Timeline,
    half: int,
) -> None:
    """One row per process, in milliseconds: the last step before, each call's parts as that process timed them
    (``Layout.seconds``), the first step after; the steps between the two calls are left out. The commit point
    is where every process has filled its stages, so each call's rows are drawn with their commits ending
    together (a process that entered the call early shows the wait in its agreement). The numbers go beside the
    picture as JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(11, 0.6 * len(shrink) + 1.6), dpi=110)
    names = list(shrink[0])
    x = _draw_step(ax, before, 0.0)
    x = _draw_parts(ax, shrink, names, x)
    gap = 0.08 * x
    ax.text(x + gap / 2, len(shrink) / 2 - 0.5, f"{half} processes\ntrain", ha="center", va="center", fontsize=8)
    x = _draw_parts(ax, grow, names, x + gap)
    _draw_step(ax, after, x)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in [*KIND_COLORS.values(), *PART_COLORS]]
    labels = ["forward", "backward", *names]
    ax.legend(handles, labels, ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.set_yticks(range(len(shrink)), [f"process {r}" for r in range(len(shrink))])
    ax.invert_yaxis()
    ax.set_xlabel("ms (the steps between the two calls left out)")
    ax.set_title("1F1B step | relayout([0, 1]) | relayout(schedule='gpipe') | GPipe step", fontsize=10)
    fig.savefig(path, bbox_inches="tight")
    record = {"shrink": shrink, "grow": grow, "before_ms": before.makespan * 1e3, "after_ms": after.makespan * 1e3}
    path.with_suffix(".json").write_text(json.dumps(record, indent=1))


def _draw_step(ax: Any, timeline: Timeline, x: float) -> float:
    """A measured step's compute from ``x`` on; returns where it ends (ms)."""
    t0 = min(e.start for e in timeline.events)
    for e in timeline.events:
        color = KIND_COLORS.get(e.action.kind.value)
        if color is not None:
            ax.barh(e.rank, (e.end - e.start) * 1e3, left=x + (e.start - t0) * 1e3, color=color, height=0.6)
    return x + timeline.makespan * 1e3


def _draw_parts(ax: Any, seconds: list[dict[str, float]], names: list[str], x: float) -> float:
    """Each process's parts of one call, from ``x`` on, their commits ending together; returns the last end (ms)."""
    committed = [sum(mine.get(n, 0.0) for n in names[: names.index("commit") + 1]) * 1e3 for mine in seconds]
    ends = []
    for rank, mine in enumerate(seconds):
        left = x + max(committed) - committed[rank]
        for name, color in zip(names, PART_COLORS, strict=False):
            width = mine.get(name, 0.0) * 1e3
            ax.barh(rank, width, left=left, color=color, height=0.6)
            left += width
        ends.append(left)
    return max(ends)


if __name__ == "__main__":
    main()
