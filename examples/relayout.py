"""A live re-layout: train on 4 processes, go to 2 (two retire, holding nothing), come back to 4 with another
schedule, all in the same processes; the state moves exactly (see docs/guides/relayout.md).

    stagewise run -n 4 examples/relayout.py
    stagewise run -n 4 examples/relayout.py --timeline docs/relayout-timeline.png   # a step before and after

Every process reads the same global batch and passes its share (``pipe.local_batch``), so nothing about the
data changes when the stage-0 and last ranks do.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import stagewise as sw

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
    parser.add_argument("--timeline", default=None, help="draw the last step before and after the re-layouts here")
    args = parser.parse_args()
    env = sw.init()
    opt = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731 (the pipeline's own: it moves along)
    pipe = sw.Pipeline(layers(), loss_fn=loss_fn, optimizer=opt, microbatches=4, seed=0)
    train(pipe, range(0, args.steps), env.rank)
    before = pipe.timeline(gather=True) if args.timeline else None  # (a collective: every process)
    half = list(range(max(1, env.world_size // 2)))
    layout = pipe.relayout(half)  # every process calls it; the others now hold nothing
    if env.rank == 0:
        log.warning("now on %s: %s, %d bytes moved", layout.members, layout.seconds, layout.bytes_moved)
    if env.rank in half:
        train(pipe, range(args.steps, 2 * args.steps), env.rank)
    layout = pipe.relayout(schedule="gpipe")  # all of them again, another schedule
    if env.rank == 0:
        log.warning("now on %s (%s): inputs at %s", layout.members, layout.schedule, layout.inputs_at)
    train(pipe, range(2 * args.steps, 3 * args.steps), env.rank)
    if before is not None:
        after = pipe.timeline(gather=True)
        if env.rank == 0:
            from stagewise.render import render_stack

            took = sum(layout.seconds.values()) * 1e3
            titles = ["before (1F1B)", "after relayout([0, 1]), then relayout(schedule='gpipe')"]
            title = f"A step before and after two live re-layouts (the second took {took:.0f} ms)"
            render_stack([before, after], args.timeline, titles=titles, title=title)


if __name__ == "__main__":
    main()
