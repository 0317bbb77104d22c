"""HetPipe's wave-synchronous parallel against synchronous data parallelism, one virtual worker EMULATED 2x slower.

    flock /tmp/sw-bench.lock nice -n -10 .venv/bin/python -m benchmarks.hetpipe_wsp
    .venv/bin/python -m benchmarks.hetpipe_wsp --samples 3072 --json out/hetpipe.json

Run as a module, it starts its two ranks (torchrun) running itself.

Two virtual workers of one rank each (2 x pp1: one process per core on a
2-core machine), rank 1 slowed down by ``emulate_slowdown=2.0`` (after each
compute action it sleeps as long as the action took: an emulation of a slower
device, not a real one). Every row trains the digits MLP (64-128-128-128-10)
from the same initial weights on the same samples (each VW its own seeded
stream; sync DP steps on the two VWs' k-th mini-batches together), SGD with
momentum, the same total number of samples:

* ``sync-dp``: ``Pipeline(parallel=ParallelConfig(pp=1, dp=2))``, one
  all-reduce of averaged gradients per step: each step waits for the slow rank;
* ``sync-dp as WSP (D=0, wave 1)``: the arithmetic of sync DP (the tests check
  it against one process to 1e-12), through HetPipe's machinery: one all-reduce per step;
* ``hetpipe-wsp D=d``: ``HetPipe`` with waves of ``--wave`` mini-batches and
  staleness bound d (D = 0: a barrier per wave; larger D lets the fast VW run
  ahead - but at most D waves, so over a long run it still waits);
* ``hetpipe-wsp D=1, waves by speed``: the fast VW's wave holds twice the
  slow one's mini-batches, so both finish a wave at once (HetPipe balances
  devices between VWs; here the work is balanced instead).

Columns: samples/s (all VWs' samples over the slowest rank's wall time), the
global model's loss on the whole training set and the held-out accuracy after
training, the most waves a VW ran ahead. Rank 0 prints a markdown table.
:func:`rows` is what the seeds' comparison calls (one dict per row, with the
loss curve per wave).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw

from ._launch import launched, on_ranks
from .compare.workloads import load_digits  # the comparison's digits split
from .compare.workloads import minibatches as stream

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """One row: ``staleness`` None is the synchronous data-parallel baseline; ``wave`` per VW (mini-batches)."""

    name: str
    family: str  # "sync" or "async"
    staleness: int | None
    wave: tuple[int, int]


def variants(wave: int) -> list[Variant]:
    return [
        Variant("sync-dp", "sync", None, (1, 1)),
        Variant("sync-dp as WSP (D=0, wave 1)", "sync", 0, (1, 1)),
        Variant("hetpipe-wsp D=0", "sync", 0, (wave, wave)),
        Variant("hetpipe-wsp D=1", "async", 1, (wave, wave)),
        Variant("hetpipe-wsp D=2", "async", 2, (wave, wave)),
        Variant("hetpipe-wsp D=1, waves by speed", "async", 1, (2 * wave, wave)),
    ]


def mlp_layers(hidden: int = 128) -> list[sw.Layer]:
    widths = [64, hidden, hidden, hidden]
    out: list[sw.Layer] = []
    for a, b in zip(widths, widths[1:]):
        out += [sw.Layer(nn.Linear, a, b), sw.Layer(nn.ReLU)]
    return out + [sw.Layer(nn.Linear, widths[-1], 10)]


def _optimizer(lr: float) -> Any:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def _train(
    v: Variant, mine: list[Batch], *, lr: float, seed: int, slowdown: float, hidden: int
) -> tuple[list[float], int, Any, list[float], float]:
    """Train row ``v`` on this rank's mini-batches: (the loss per wave, or per step for sync DP; the most waves a VW
    ran ahead; the model; when this rank finished each wave or step; when the timing started)."""
    rank = dist.get_rank()
    factors = [1.0, slowdown]
    if v.staleness is None:
        pipe = sw.Pipeline(
            mlp_layers(hidden), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=1, optimizer=_optimizer(lr),
            seed=seed, parallel=sw.ParallelConfig(pp=1, dp=2), emulate_slowdown=factors[rank],
        )  # fmt: skip
        dist.barrier()
        t0 = time.perf_counter()
        losses = []
        ends = []
        for xb, yb in mine:  # each rank its own half of the global batch
            losses.append(pipe.train_step(xb, yb))
            ends.append(time.perf_counter() - t0)
        return losses, 0, pipe, ends, t0
    het = sw.HetPipe(
        mlp_layers(hidden), loss_fn=F.cross_entropy, virtual_workers=[[0], [1]], staleness=v.staleness,
        schedule="1f1b", microbatches=1, wave=list(v.wave), optimizer=_optimizer(lr), seed=seed,
        emulate_slowdown=factors,
    )  # fmt: skip
    dist.barrier()
    t0 = time.perf_counter()
    ends = []
    for k, _ in enumerate(het.train_stream(mine), start=1):
        if k % v.wave[rank] == 0 or k == len(mine):
            ends.append(time.perf_counter() - t0)  # this VW finished a wave
    return het.stats.global_losses, het.stats.max_lead, het.pipe, ends, t0


def run_variant(
    v: Variant,
    data: tuple[torch.Tensor, ...],
    *,
    samples: int,
    batch: int,
    lr: float,
    seed: int,
    slowdown: float,
    hidden: int = 128,
) -> dict[str, Any]:
    """Train one row on 2 ranks (a collective); every rank returns the same record."""
    x, y, x_test, y_test = data
    rank = dist.get_rank()
    share = v.wave[rank] / sum(v.wave)  # this VW's part of the samples
    count = round(samples * share / batch)
    mine = stream(x, y, count, batch, seed * 100 + rank)
    dist.barrier()
    per_wave, lead, model, ends, t0 = _train(v, mine, lr=lr, seed=seed, slowdown=slowdown, hidden=hidden)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    wave_ends = torch.tensor(ends, dtype=torch.float64)  # when the last VW finished each wave (or step)
    dist.all_reduce(wave_ends, op=dist.ReduceOp.MAX)
    done = torch.tensor([float(count * batch)], dtype=torch.float64)
    dist.all_reduce(done)
    with torch.no_grad():
        model.reset_shapes()
        train_loss = float(F.cross_entropy(model.eval_step(x), y))
        model.reset_shapes()
        logits = model.eval_step(x_test)
    step = done.item() / len(per_wave)
    return {
        "name": v.name,
        "family": v.family,
        "samples": int(done.item()),
        "samples_per_s": done.item() / elapsed.item(),
        "curve": [  # (samples, seconds, loss) per wave: the mean loss over the VWs
            ((k + 1) * step, float(t), float(loss)) for k, (t, loss) in enumerate(zip(wave_ends.tolist(), per_wave))
        ],
        "train_loss": train_loss,
        "val_loss": float(F.cross_entropy(logits, y_test)),
        "val_accuracy": float((logits.argmax(1) == y_test).float().mean()),
        "max_lead": lead,
        "seed": seed,
    }


def rows(
    *,
    samples: int = 3072,
    batch: int = 32,
    wave: int = 4,
    lr: float = 0.05,
    seed: int = 0,
    slowdown: float = 2.0,
    hidden: int = 128,
) -> list[dict[str, Any]]:
    """Every variant's record (a collective on a 2-rank world, e.g. under ``stagewise run -n 2``).

    Keys: ``name``, ``family`` (sync/async), ``samples``, ``samples_per_s``, ``curve`` ((samples, seconds, loss)
    per wave, the mean over the VWs; per step for sync-dp), ``train_loss``, ``val_loss``, ``val_accuracy``,
    ``max_lead``, ``seed``. ``hidden``: the MLP's width (128: the comparison's digits MLP).
    """
    if dist.get_world_size() != 2:
        raise ValueError(f"hetpipe_wsp runs on 2 ranks (2 VWs x pp1), got {dist.get_world_size()}")
    data = load_digits()
    return [
        run_variant(v, data, samples=samples, batch=batch, lr=lr, seed=seed, slowdown=slowdown) for v in variants(wave)
    ]


def markdown(by_seed: list[list[dict[str, Any]]]) -> str:
    """One line per variant: mean ± standard deviation over the seeds."""

    def pair(values: list[float], digits: int) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"

    lines = [
        "| method | sync/async | samples | samples/s | vs sync-dp | train loss | val accuracy | max lead (waves) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = statistics.fmean(run[0]["samples_per_s"] for run in by_seed)
    for k, first in enumerate(by_seed[0]):
        rs = [run[k] for run in by_seed]
        speed = [r["samples_per_s"] for r in rs]
        lines.append(
            f"| {first['name']} | {first['family']} | {first['samples']} | {pair(speed, 0)} | "
            f"{statistics.fmean(speed) / base:.2f}x | {pair([r['train_loss'] for r in rs], 3)} | "
            f"{pair([r['val_accuracy'] for r in rs], 3)} | {max(r['max_lead'] for r in rs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--wave", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, default=128, help="MLP width (128: the comparison's digits MLP)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not launched():  # python -m benchmarks.hetpipe_wsp: start the two ranks, each running this module
        sys.exit(on_ranks(2, "benchmarks.hetpipe_wsp", sys.argv[1:]))
    torch.set_num_threads(1)
    sw.init()
    records = [
        rows(
            samples=args.samples,
            batch=args.batch,
            wave=args.wave,
            lr=args.lr,
            seed=args.seed + k,
            slowdown=args.slowdown,
            hidden=args.hidden,
        )  # fmt: skip
        for k in range(args.seeds)
    ]
    if dist.get_rank() == 0:
        print(markdown(records))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
