"""The backward of one pipeline stage, kernel by kernel: PyTorch's engine against stagewise's I / W / B.

    .venv/bin/python -m benchmarks.backward_kernels [--rows 8] [--width 1024]

A stage of 2 x (Linear(width, width) + ReLU) on a micro-batch of ``rows``
rows, one thread; four such stages take turns so that each stage's weights
leave the cache as they do in a pipeline. Per stage, ms of wall time after
its forward (subtracted):

* *autograd.grad to the input*: the input gradient alone (what the ideal's I was);
* *stagewise I*: ``backward_input`` (the same pass, plus the graph walk and the stash W needs: each linear
  layer's input and output gradient; see ``runtime/engine/backward.py``);
* *stagewise I then W*: with W's fused accumulation (``weight.grad.addmm_(grad.T, x)``);
* *stagewise B*: ``backward_full`` (I then W at once, as B runs from ``FUSE_B_MIN_WEIGHTS``);
* *engine backward*: ``out.backward(g)``: the weight gradient made in a temporary, then added to ``.grad``.

``benchmarks/split_backward.py`` measures the same per stage of whole models.

And per layer, the weight-gradient accumulation alone: ``grad.add_(mm(g.T, x))`` against ``grad.addmm_(g.T, x)``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

# internal: this benchmark times the runtime's backward kernels themselves (I, W, B), which have no public
# name: a user never calls them, the interpreter does
from stagewise.runtime.engine.backward import backward_full, backward_input, backward_weight

STAGES = 4  # stages taking turns, so that each one's weights leave the cache as in a pipeline


def _clock(fn: Callable[[], None], repeat: int) -> float:
    """ms per stage of ``fn`` (which runs every stage): the mean over ``repeat`` calls after one warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat / STAGES * 1e3


def stage_backwards(w: int, r: int, repeat: int) -> None:
    """The table of a stage's backward, kernel by kernel, its forward subtracted."""
    stages = [nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU()) for _ in range(STAGES)]
    g = torch.randn(r, w)

    def fwd() -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for s in stages:
            x = torch.randn(r, w, requires_grad=True)
            out.append((x, s(x)))
        return out

    def grad_to_input() -> None:
        for x, o in fwd():
            torch.autograd.grad(o, [x], g)

    def sw_i() -> None:
        for x, o in fwd():
            backward_input([o], [g], [x])

    def sw_iw() -> None:
        works = [backward_input([o], [g], [x])[1] for x, o in fwd()]
        for work in works:
            backward_weight(work)

    def sw_b() -> None:
        for x, o in fwd():
            backward_full([o], [g], [x])

    def engine() -> None:
        for _, o in fwd():
            o.backward(g)

    forward = _clock(lambda: None if fwd() else None, repeat)
    print(f"rows {r}, width {w}; forward {forward:.3f} ms per stage (subtracted below)\n")
    print("| per stage | ms |\n|---|---:|")
    for label, fn in (
        ("autograd.grad to the input", grad_to_input),
        ("stagewise I", sw_i),
        ("stagewise I then W (fused)", sw_iw),
        ("stagewise B", sw_b),
        ("engine backward", engine),
    ):
        print(f"| {label} | {_clock(fn, repeat) - forward:.3f} |")


def accumulation(w: int, r: int, repeat: int) -> None:
    """Per layer, the weight-gradient accumulation alone: ``add_(mm(...))`` against ``addmm_``."""
    gg, x = torch.randn(r, w), torch.randn(r, w)
    grads = [torch.zeros(w, w) for _ in range(8)]

    def unfused() -> None:
        for acc in grads:
            acc.add_(torch.mm(gg.t(), x))

    def fused() -> None:
        for acc in grads:
            acc.addmm_(gg.t(), x)

    scale = STAGES / len(grads) * 1e3  # _clock() divides by the stage count: per layer, in us
    unfused_us, fused_us = _clock(unfused, repeat) * scale, _clock(fused, repeat) * scale
    print(f"\nper layer: mm + add_ {unfused_us:.0f} us, addmm_ {fused_us:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    stage_backwards(args.width, args.rows, args.repeat)
    accumulation(args.width, args.rows, args.repeat)


if __name__ == "__main__":
    main()
