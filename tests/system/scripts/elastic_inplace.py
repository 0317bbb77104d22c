"""A small in-place elastic job (tests/system/test_elastic_inplace.py, benchmarks/elastic_inplace.py).

Each worker is started with RANK, WORLD_SIZE, GROUP_RANK (its machine), STAGEWISE_STORE (the store of
``stagewise rendezvous``), TORCHELASTIC_RUN_ID and STAGEWISE_SNAPSHOT_DIR (its machine's memory folder), as
``stagewise run --in-place`` starts it, and trains with :class:`stagewise.runtime.InPlace`:
``--layout dp`` (``ElasticLayout(pp=1, batch=24, microbatch_size=2)``: a lost machine held a replica) or
``--layout pp2`` (``ElasticLayout(pp=2, ...)``: a lost machine of two processes held a stage of some replicas)
or ``--layout stages`` (pp = the world, dp 1: a lost machine held the only live copy of a stage), float64,
snapshots every step.

* ``--hold STEP``: after STEP (generation 0), every worker leaves ``hold-<id>`` and waits for ``go``: the test
  loses a machine meanwhile (a kill) and then says go;
* ``--hold-again STEP``: the same in generation 1 (``again-<id>``, ``go-again``);
* started with ``STAGEWISE_JOIN=1`` (and no RANK): a newcomer, it joins the running job at a step boundary;
* ``--die ID:STEP``: worker ID SIGKILLs itself as STEP starts (the others are inside STEP: a death mid-step);
* ``--cut ID:STEP``: worker ID stops itself (SIGSTOP) from its snapshot helper once ``train_step(STEP)`` returned,
  before its copy of STEP leaves: a machine cut off between a step and its snapshot's copy;
* ``--settle S``: at the end, wait S seconds before the last event (threads and descriptors counted);
* ``--save-held``: at ``--hold``, every worker saves the step's state into ``held`` (a reference job of
  another size starts from it);
* ``--save-resumed``: after each recovery, every member saves the state it went on from into
  ``resumed-g<G>`` (the reference job starts from it);
* ``--reference DIR``: a fresh job that resumes from the checkpoint in DIR (no snapshots of its own yet).

Writes ``events.jsonl`` (every worker: its id, pid, generation, members and what happened, in order) and
``losses.jsonl`` (rank 0 of each generation: step, loss, generation, world), and each worker's own rows in
``mine-<id>.jsonl``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.parallel import Fit


class StagesLayout:
    """A pipeline one process per stage at every size (pp = world, dp 1): every stage has one live copy, so a
    lost machine takes the only live copy of its stage (it comes back from the copy on its next machine) and
    the survivors cut the model into fewer stages. (``ElasticLayout`` keeps pp fixed: with it a lost machine
    always leaves another replica of each stage.)"""

    def at(self, world: int) -> Fit:
        return Fit(world, sw.ParallelConfig(pp=world), 12, 2)


LAYOUTS: dict[str, Any] = {
    "dp": sw.ElasticLayout(pp=1, batch=24, microbatch_size=2),
    "pp2": sw.ElasticLayout(pp=2, batch=24, microbatch_size=2),
    "stages": StagesLayout(),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hold", type=int, default=0)
    p.add_argument("--hold-again", type=int, default=0)
    p.add_argument("--die", default="", help="ID:STEP: worker ID kills itself as step STEP starts")
    p.add_argument("--cut", default="", help="ID:STEP: worker ID stops before its copy of STEP leaves")
    p.add_argument("--save-resumed", action="store_true")
    p.add_argument("--save-held", action="store_true", help="at --hold, save the step's state into held/")
    p.add_argument("--settle", type=float, default=0.0, help="seconds to wait before counting threads at the end")
    p.add_argument("--reference", type=Path, default=None)
    p.add_argument("--no-count", action="store_true", help="events count no threads or descriptors (benchmarks)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="dp", help="dp: pp 1, dp over the machines; "
                   "pp2: pp 2, dp over the rest; stages: pp over the machines, dp 1")  # fmt: skip
    args = p.parse_args()
    torch.set_default_dtype(torch.float64)
    me = int(os.environ.get("RANK", "-1"))  # a newcomer's id is claimed in job.start()
    out: Path = args.out

    def note(what: str, **more: Any) -> None:
        row = {"id": me, "pid": os.getpid(), "gen": job.generation, "members": job.members, "what": what, **more}
        row["t"] = time.time()
        if args.no_count:  # (a benchmark: a full collection here would be timed as part of the recovery)
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            return
        gc.collect()  # (what the last generation left in reference cycles goes, with its helper threads)
        row.update(threads=threading.active_count(), fds=len(os.listdir("/proc/self/fd")))
        row["names"] = sorted(t.name for t in threading.enumerate())
        with open(out / "events.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    old: list[weakref.ref[torch.Tensor]] = []  # the tensors of the pipeline at --hold (generation 0)

    def recovered(j: sw.runtime.InPlace) -> None:
        r = j.recoveries[-1]
        alive = _alive(old, j.pipe)  # before any collection: what the recovery left alive at once
        note(
            "recovered",
            failed_at=r.failed_at,
            committed=r.committed,
            seconds=r.seconds,
            parts=r.parts,
            sources=r.sources,
            old_alive=alive,
        )
        if args.save_resumed:
            sw.checkpoint.save(out / f"resumed-g{j.generation}", j.pipe, step=j.step)
        (out / f"recovered-{me}").touch()

    job = sw.runtime.InPlace(
        LAYOUTS[args.layout],
        functools.partial(build, deep=args.layout != "dp"),
        checkpoints=args.reference or out / "ckpt",
        timeout=10,
        deadline_s=8,
        after_recovery=recovered,
    )
    job.start()
    me = job.me
    note("started", step=job.step)
    if args.cut and me == int(args.cut.split(":")[0]):
        cut_before_copy(int(args.cut.split(":")[1]))
    if args.save_resumed and job.generation > 0:  # a newcomer: where the members save theirs (after_recovery)
        sw.checkpoint.save(out / f"resumed-g{job.generation}", job.pipe, step=job.step)
    data = torch.randn(24 * args.steps, 6, generator=torch.Generator().manual_seed(0))
    name = "reference.jsonl" if args.reference else "losses.jsonl"
    for step, loss in job.run(
        args.steps, lambda s: (data[24 * (s - 1) : 24 * s], data[24 * (s - 1) : 24 * s, :3].argmax(1))
    ):
        row = {"step": step, "loss": loss, "gen": job.generation, "world": len(job.members), "t": time.time()}
        row["committed"] = job.pipe.committed_step  # (read after the step: the step before, or this one)
        if dist_rank() == 0:
            with open(out / name, "a") as f:
                f.write(json.dumps(row) + "\n")
        with open(out / f"mine-{me}.jsonl", "a") as f:  # every worker's own (a newcomer's among them)
            f.write(json.dumps(row) + "\n")
        if step == args.hold and job.generation == 0:
            old[:] = [weakref.ref(t) for t in _tensors(job.pipe)]
            if args.save_held:
                sw.checkpoint.save(out / "held", job.pipe, step=step)
            hold(job, out / f"hold-{me}", out / "go")
        if step == args.hold_again and job.generation == 1:
            hold(job, out / f"again-{me}", out / "go-again")
        if args.die and [me, step + 1] == [int(x) for x in args.die.split(":")]:
            job.pipe.snapshots.wait()  # its snapshot of this step sent: committed once the peers wrote theirs
            note("dies", step=step + 1)
            os.kill(os.getpid(), signal.SIGKILL)  # the others are inside the next step: a death mid-step
    if args.settle:  # the last snapshot written, and a wait left in a dead group ended (its timeout): then count
        job.pipe.snapshots.wait()
        time.sleep(args.settle)
    note("finished", step=job.step)
    return 0


def cut_before_copy(step: int) -> None:
    """This worker's snapshot helper stops the process just before its copy of ``step`` would leave."""
    from stagewise.runtime.elastic import snapshot_copies

    deliver = snapshot_copies.deliver

    def stopping(snap: Any, at: int, *rest: Any) -> None:
        if at == step:
            os.kill(os.getpid(), signal.SIGSTOP)
        deliver(snap, at, *rest)

    snapshot_copies.deliver = stopping


def hold(job: sw.runtime.InPlace, here: Path, go: Path) -> None:
    """The snapshot of this step whole on every machine (committed), then wait for ``go``."""
    job.pipe.snapshots.wait()
    here.touch()
    while not go.exists():
        time.sleep(0.05)


def _tensors(pipe: Any) -> list[torch.Tensor]:
    """A pipeline's parameters, gradients, buffers and optimizer state (the tensor objects themselves)."""
    out = [*pipe.parameters(), *pipe.buffers()]
    out += [p.grad for p in pipe.parameters() if p.grad is not None]
    for opt in pipe.optimizers.values():
        out += [v for entries in opt.state.values() for v in entries.values() if isinstance(v, torch.Tensor)]
    return out


def _alive(refs: list[weakref.ref[torch.Tensor]], new: Any) -> int:
    """How many of the old pipeline's tensors are alive and not the new pipeline's own (a kept optimizer state is
    taken over as it is; a kept parameter's storage is aliased by a new tensor, so its old object goes)."""
    used = {id(t) for t in _tensors(new)} if new is not None else set()
    return sum(1 for r in refs if r() is not None and id(r()) not in used)


def build(fit: Any, deep: bool = False) -> sw.Pipeline:
    layers = [sw.Layer(nn.Linear, 6, 16), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 16, 3)]
    if deep:  # (a layer with parameters on every stage of three)
        layers[2:] = [sw.Layer(nn.Linear, 16, 16), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 16, 3)]
    return sw.Pipeline(
        layers, loss_fn=F.cross_entropy, parallel=fit.parallel, microbatches=fit.microbatches, seed=3,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), snapshot=1, timeout=10,
    )  # fmt: skip


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


if __name__ == "__main__":
    raise SystemExit(main())
