"""One rank of ``python -m benchmarks.pipeline_vs_torch``: times one config's schedules with both libraries.

Started by torchrun (one job per rank count and config). For each schedule
it builds the same model, cut the same way, with ``torch.distributed.pipelining``
and with ``stagewise.Pipeline`` on each transport (gloo point-to-point,
shared memory), the latter both on stagewise's schedule of that name and on
torch's own order of the class (what torch's ``step()`` runs, read with
``stagewise.runtime.torch_order``), warms each up, then times training steps with them taking
turns step by step (rotating which goes first), so changes in background
load hit all alike. A step's
time is the slowest rank's, from a barrier to its end; its CPU time the
busiest rank's (all threads of the process); its *waiting* time the ranks'
mean time ready to run with no CPU free (other processes had it). After
each pair of steps every rank also times one micro-batch through its own
stages, rebuilt outside both libraries (``RankCompute``), so the stage costs
behind the ideal are measured under the same load as the steps. Rank 0
writes one JSON file with every step's figures and the stage costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw

from .model import SCHEDULES, Config, RankCompute, block, blocks_of_stage, stages_of_rank, torch_schedule

Step = Callable[[], None]


def stagewise_step(
    cfg: Config,
    name: str,
    rank: int,
    p: int,
    x: torch.Tensor,
    y: torch.Tensor,
    transport: str = "auto",
    order: str = "stagewise",
) -> tuple[Step, Any]:
    """stagewise's runtime on stagewise's schedule ``name`` (``order="stagewise"``) or on the torch class's
    own order, as its ``step()`` runs it (``order="torch"``: the same order the ``torch`` column runs)."""
    layers = [sw.Layer(block, cfg.width) for _ in range(cfg.blocks)]
    v = SCHEDULES[name][2]
    schedule: str | sw.Schedule = name
    if order == "torch":
        schedule = torch_schedule(name, p, cfg.microbatches)
    pipe = sw.Pipeline(
        layers,
        loss_fn=F.mse_loss,
        schedule=schedule,
        microbatches=cfg.microbatches if order == "stagewise" else None,
        virtual_stages=v if order == "stagewise" else None,
        seed=0,
        transport=transport,
    )

    def step() -> None:
        pipe.train_step(x, y)

    return step, pipe


def torch_step(cfg: Config, name: str, rank: int, p: int, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, Any]:
    from torch.distributed import pipelining as pp

    cls_name, placement, v = SCHEDULES[name]
    n = p * v
    local = stages_of_rank(placement, rank, p, v)
    stages = []
    for s in local:
        module = nn.Sequential(*[_seeded_block(cfg, k) for k in blocks_of_stage(cfg.blocks, n, s)])
        stages.append(pp.PipelineStage(module, s, n, torch.device("cpu")))
    cls = getattr(pp, cls_name)
    arg = stages[0] if v == 1 else stages
    schedule = cls(arg, cfg.microbatches, loss_fn=F.mse_loss)
    first = 0 in local
    last = n - 1 in local

    def step() -> None:
        args = (x,) if first else ()
        if last:
            schedule.step(*args, target=y, losses=[])
        else:
            schedule.step(*args)

    return step, (schedule, stages)


def _seeded_block(cfg: Config, k: int) -> nn.Module:
    return sw.Layer(block, cfg.width).build(seed=k)


def rank_compute(cfg: Config, name: str, rank: int, p: int) -> RankCompute:
    """This rank's stages of schedule ``name``, rebuilt to time their compute alone."""
    _, placement, v = SCHEDULES[name]
    n = p * v
    local = stages_of_rank(placement, rank, p, v)
    return RankCompute(cfg, [(len(blocks_of_stage(cfg.blocks, n, s)), s == 0, s == n - 1) for s in local])


def timed(step: Step) -> tuple[float, float, float]:
    """One step, from a barrier to this rank's end of it.

    Returns its wall time, this process's CPU time (all threads) and how long
    the main thread was ready to run but waited for a CPU (other processes
    had it): the share of the machine this rank did not get.
    """
    dist.barrier()
    c0, q0, t0 = time.process_time(), _run_delay(), time.perf_counter()
    step()
    return time.perf_counter() - t0, time.process_time() - c0, _run_delay() - q0


def _run_delay() -> float:
    """Seconds this thread has spent runnable but not running (Linux schedstat; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def across_ranks(values: list[float], op: Any) -> list[float]:
    """Per step, the values of every rank combined by ``op`` (max, or sum)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


#: what is timed: torch.distributed.pipelining, and stagewise on each transport, on its own schedule and on
#: torch's order of the same class (``@torch``)
BUILDERS: dict[str, Callable[..., tuple[Step, Any]]] = {
    "torch": torch_step,
    "sw-gloo": functools.partial(stagewise_step, transport="torch"),
    "sw-shm": functools.partial(stagewise_step, transport="shm"),
    "sw-gloo@torch": functools.partial(stagewise_step, transport="torch", order="torch"),
    "sw-shm@torch": functools.partial(stagewise_step, transport="shm", order="torch"),
}


def start_rank(config: str) -> tuple[int, int, Config, torch.Tensor, torch.Tensor]:
    """One thread, the gloo group, and the config's batch (the same on every rank): (rank, ranks, config, x, y)."""
    torch.set_num_threads(1)
    sw.init(backend="gloo")
    cfg = Config.named(config)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    y = torch.randn(cfg.batch, cfg.width, generator=g)
    return dist.get_rank(), dist.get_world_size(), cfg, x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--schedules", required=True, help="comma-separated stagewise names")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--libs", default=",".join(BUILDERS), help=f"comma-separated, of {', '.join(BUILDERS)}")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    rank, p, cfg, x, y = start_rank(args.config)
    libs = args.libs.split(",")
    results: dict[str, Any] = {"config": args.config, "ranks": p, "schedules": {}}
    for name in args.schedules.split(","):
        row: dict[str, Any] = {}
        for lib in libs:
            try:
                step, keep = BUILDERS[lib](cfg, name, rank, p, x, y)
                for _ in range(args.warmup):
                    step()
                row[lib] = {"step": step, "keep": keep, "times": [], "cpu": [], "waiting": []}
            except Exception as err:  # a library that cannot run this schedule here: say so, go on
                row[lib] = {"error": f"{type(err).__name__}: {err}"}
                print(f"rank {rank}: {lib} {name}: {row[lib]['error']}", file=sys.stderr)
        compute = rank_compute(cfg, name, rank, p)
        for k in range(args.steps):  # the libraries take turns, step by step, so load changes hit all alike
            for lib in libs[k % len(libs) :] + libs[: k % len(libs)]:
                if "step" in row[lib]:
                    for key, value in zip(("times", "cpu", "waiting"), timed(row[lib]["step"])):
                        row[lib][key].append(value)
            dist.barrier()
            compute.sample()  # every rank at once, as in a step: under the same load as the steps
        for d in row.values():
            if "step" in d:  # the slowest rank's time, the busiest rank's CPU, the ranks' mean wait for a CPU
                d["times"] = across_ranks(d["times"], dist.ReduceOp.MAX)
                d["cpu"] = across_ranks(d["cpu"], dist.ReduceOp.MAX)
                d["waiting"] = [w / p for w in across_ranks(d["waiting"], dist.ReduceOp.SUM)]
        keep = ("times", "cpu", "waiting", "error")
        results["schedules"][name] = {lib: {k: v for k, v in d.items() if k in keep} for lib, d in row.items()}
        local = stages_of_rank(SCHEDULES[name][1], rank, p, SCHEDULES[name][2])
        for kernels, key in (("stagewise", "stage_costs"), ("autograd", "stage_costs_autograd")):
            mine = [(s, dataclasses.astuple(c)) for s, c in zip(local, compute.costs(kernels))]
            everyone: list[Any] = [None] * p
            dist.all_gather_object(everyone, mine)
            results["schedules"][name][key] = [c for _, c in sorted(x for rows in everyone for x in rows)]
        row.clear()
        dist.barrier()
    if rank == 0:
        args.out.write_text(json.dumps(results))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip teardown of the pipelines' helper threads and process group


if __name__ == "__main__":
    main()
