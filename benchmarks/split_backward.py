"""The split backward per pipeline stage of three workloads: B, I, W, (I + W) / B, and the bytes W holds.

    .venv/bin/python -m benchmarks.split_backward                  # the three workloads, 2 stages each
    .venv/bin/python -m benchmarks.split_backward --quick          # a smoke run: tiny sizes, few repeats
    .venv/bin/python -m benchmarks.split_backward --recompute stage

Workloads (float32, one thread, the stage cut uniformly as the Pipeline's default):

* *demo GPT*: ``examples/gpt_model.py`` as the demo trains it (d 64, 4 heads, 6 blocks, sequence 64,
  vocabulary 256), a micro-batch of 4 sequences (32 a step over 8 micro-batches);
* *GPT d256*: 8 pre-norm blocks, d 256, 4 heads, sequence 64, vocabulary 512, micro-batches of 2;
* *ResNet*: ``examples/resnet_digits.py``'s model cut at its tags, micro-batches of 16 8x8 images.

Per stage, CPU milliseconds of this thread (``time.thread_time``: robust to other processes' load, not to
cache sharing), medians over ``--repeat`` rounds, each round running every variant on a fresh forward:

* *B engine*: ``torch.autograd.backward`` (one engine pass);
* *B fused*: ``backward_full(fused=True)``, I then W at once (what B runs where the interpreter's
  ``fuses_b`` says so: a weight of ``FUSE_B_MIN_WEIGHTS`` elements or more);
* *I*, *W*: ``backward_input`` and ``backward_weight`` on one forward's graph;
* *(I+W)/B*: against the B the runtime runs for that stage (engine or fused, by the same threshold);
* *W holds*: ``WeightWork.held_bytes()`` over the bytes the forward saved for backward (the memory meter's
  ``by_forward``), and over the linear/convolution layers' inputs and output gradients (``M_W`` of the
  Zero Bubble paper, counted from the stashed shapes' own sizes: 100 % means W holds exactly that).

With ``--recompute`` the stage is checkpointed as ``Pipeline(recompute=...)`` does and B is the engine's.
The goal (issue 39): (I+W)/B <= 1.05 at d >= 256 and <= 1.15 at d 64.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.ir import Action, Kind

# internal: this benchmark times the runtime's I / W / B kernels themselves (which have no public name: a user
# never calls them, the interpreter does), the memory meter's count, and stages run as the runtime runs them
from stagewise.runtime.engine.backward import WeightWork, backward_full, backward_input, backward_weight
from stagewise.runtime.engine.compute import fuses_b
from stagewise.runtime.features.memory import ActivationMeter
from stagewise.runtime.features.recompute import run_layers

from ._examples import example

Stage = Callable[[Any], Any]


class Workload:
    """A model cut into stages: each stage's layers, one micro-batch of data and its loss."""

    def __init__(self, name: str, stages: list[list[nn.Module]], data: Any, target: Any, loss: Callable) -> None:
        self.name, self.stages, self.data, self.target, self.loss = name, stages, data, target, loss


def _uniform(mods: list[nn.Module], p: int) -> list[list[nn.Module]]:
    sizes = [len(mods) // p + (1 if k < len(mods) % p else 0) for k in range(p)]
    starts = [sum(sizes[:k]) for k in range(p)]
    return [mods[a : a + n] for a, n in zip(starts, sizes)]


def gpt(name: str, d: int, blocks: int, vocab: int, rows: int, p: int) -> Workload:
    g = example("gpt_model")
    cfg = g.GPTConfig(vocab_size=vocab, seq_len=64, d_model=d, n_heads=4, n_layers=blocks)
    model = sw.build_model(g.gpt_layers(cfg), seed=0)
    ids = torch.randint(0, vocab, (rows, 65), generator=torch.Generator().manual_seed(0))
    return Workload(name, _uniform(list(model.children()), p), ids[:, :-1], ids[:, 1:], g.lm_loss)


class _Pool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def resnet(rows: int) -> Workload:
    torch.manual_seed(0)
    model = example("resnet_digits").ResNet()
    stages = [[model.head, model.layer1, model.layer2], [model.layer3, _Pool(), model.fc]]  # its tags
    x = torch.randn(rows, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    return Workload("ResNet", stages, x, torch.arange(rows) % 10, F.cross_entropy)


def _inputs(work: Workload) -> list[Any]:
    """Each stage's input: the data, then the previous stage's output (detached, needing a gradient)."""
    out, x = [], work.data
    with torch.no_grad():
        for mods in work.stages:
            out.append(x)
            x = run_layers(mods, x, None)
    return out


def _forward(work: Workload, s: int, x0: Any, recompute: Any) -> tuple[list[torch.Tensor], list[Any], Any]:
    """(roots, their gradients, the input leaf or None) of one forward of stage ``s``, as the interpreter has
    them."""
    x = x0.detach().requires_grad_(s > 0)  # stage 0's data needs no gradient
    y = run_layers(work.stages[s], x, recompute)
    if s == len(work.stages) - 1:
        return [work.loss(y, work.target)], [None], x
    return [y], [torch.full_like(y, 1e-3)], x


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.thread_time()
    out = fn()
    return out, (time.thread_time() - t) * 1e3


def _round(work: Workload, s: int, x0: Any, recompute: Any) -> dict[str, float]:
    inputs = lambda x: [x] if x.requires_grad else []  # noqa: E731
    roots, grads, x = _forward(work, s, x0, recompute)
    _, engine = _timed(lambda: torch.autograd.backward(roots, [g for g in grads]))
    roots, grads, x = _forward(work, s, x0, recompute)
    _, fused = _timed(lambda: backward_full(roots, grads, inputs(x), fused=recompute is None))
    roots, grads, x = _forward(work, s, x0, recompute)
    ckpt = [p for m in work.stages[s] for p in m.parameters()] if recompute is not None else []
    (_, w), ti = _timed(lambda: backward_input(roots, grads, inputs(x), checkpointed=ckpt))
    _, tw = _timed(lambda: backward_weight(w))
    return {"engine": engine, "fused": fused, "i": ti, "w": tw}


def _bytes(work: Workload, s: int, x0: Any, recompute: Any) -> tuple[int, int, int]:
    """(bytes the forward saved, bytes W holds, the deferred ops' inputs and output gradients by their sizes)."""
    at: list[Any] = [None]
    meter = ActivationMeter([p for m in work.stages[s] for p in m.parameters()], lambda: at[0])
    with meter.hooks():
        at[0] = Action(s, Kind.F, 0)
        roots, grads, x = _forward(work, s, x0, recompute)
        at[0] = None
    ckpt = [p for m in work.stages[s] for p in m.parameters()] if recompute is not None else []
    _, held = backward_input(roots, grads, [x] if x.requires_grad else [], checkpointed=ckpt)
    return meter.by_forward[(s, 0)], held.held_bytes(), _own_sizes(held)


def _own_sizes(work: WeightWork) -> int:
    return sum(t.numel() * t.element_size() for item in work.stash for t in (item.x, item.g) if t is not None)


def _stage_row(work: Workload, s: int, x0: Any, repeat: int, recompute: Any) -> dict[str, Any]:
    rounds = [_round(work, s, x0, recompute) for _ in range(repeat + 1)][1:]  # the first warms up
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    fuse = recompute is None and fuses_b([p for m in work.stages[s] for p in m.parameters()])  # as the runtime
    saved, held, sizes = _bytes(work, s, x0, recompute)
    b = med["fused"] if fuse else med["engine"]
    return {**med, "b": b, "fuse": fuse, "ratio": (med["i"] + med["w"]) / b, "saved": saved, "held": held,
            "sizes": sizes}  # fmt: skip


def table(works: list[Workload], repeat: int, recompute: Any) -> None:
    print(f"CPU ms per stage and micro-batch, median of {repeat}; recompute={recompute}\n")
    print("| workload | stage | B engine | B fused | B runs | I | W | (I+W)/B | W holds / F saved | / M_W |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for work in works:
        for s, x0 in enumerate(_inputs(work)):
            r = _stage_row(work, s, x0, repeat, recompute)
            share, mw = r["held"] / r["saved"], r["held"] / max(r["sizes"], 1)
            print(
                f"| {work.name} | {s} | {r['engine']:.2f} | {r['fused']:.2f} | {'fused' if r['fuse'] else 'engine'} "
                f"| {r['i']:.2f} | {r['w']:.2f} | {r['ratio']:.2f} | {share:.0%} | {mw:.0%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--recompute", default=None, help="'stage' or a layer count: checkpoint each stage")
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, 3 repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    recompute = int(args.recompute) if args.recompute and args.recompute.isdigit() else args.recompute
    p = args.stages
    if args.quick:
        works = [gpt("GPT d32", 32, 2, 64, 2, p), resnet(4)]
        repeat = 3
    else:
        works = [gpt("demo GPT d64", 64, 6, 256, 4, p), gpt("GPT d256", 256, 8, 512, 2, p), resnet(16)]
        repeat = args.repeat
    table(works, repeat, recompute)


if __name__ == "__main__":
    main()
