"""An elastic float64 job that trains until it is stopped: one row per committed step, for the recovery benchmark.

    stagewise run -n 2 --nnodes 2:3 --max-restarts 50 --rdzv-endpoint HOST:PORT --rdzv-id ID \
        tests/system/scripts/steady_train.py --out DIR --every 1 --timeout 10

elastic_train.py's model, optimizer, data and layout (``ElasticLayout(pp=2, batch=24, microbatch_size=2)``;
step ``s`` trains on the samples ``24 (s - 1) .. 24 s - 1``, drawn from seed ``100 + s`` at every size), so
its ``--reference`` mode replays any stretch of this job. Rank 0 writes, in DIR:

* ``steps.jsonl``: one row per step trained to its end (``train_step`` returned: every stage stepped):
  step, world, wall time, the samples ``[first, end)``, the loss (float64), and ``run`` - a name rank 0 draws
  at the start of each process group (a restart of the survivors is a new run); in place, written by the
  generation's first member, and the same rows by its last in ``steps.last.jsonl`` (a row the first lost with
  its machine: benchmarks/recovery/lineage.py);
* ``resumes.jsonl``: each resume: step, world, source, run, time; ``--keep-resumed``: the state right after
  it, saved as ``resumed/w<W>-s<S>`` (where a replay starts); in place also the recovery's ``seconds`` and
  ``parts`` and when the state was ``restored`` (before that save);
* ``recoveries.jsonl`` (in place, every member): its own recovery's parts, and how the agreement counted each
  member (asked, named dead, its port refusing, silent) with what its probes of the peers' ports got;
* ``silences.jsonl`` (in place, every member): each time the longest stand-still this worker read of a live
  member's stamps grew by a tenth of a second (``InPlace.live_silence_s``): the margin against ``silence_s``.

Nothing is printed per step, so a machine's log holds only what the runtime says. ``--timeout`` is the
pipeline's hang threshold (``Pipeline(timeout=)``): a stopped or cut-off peer is given up after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

import elastic_train as et
import stagewise as sw
from helpers import models as mdl


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--every", type=int, default=1, help="snapshot= (0: none, checkpoints only)")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint on disk every N steps (0: none)")
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--start-world", type=int, default=0, help="a fresh start at fewer processes waits for more")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--keep-resumed", action="store_true")
    p.add_argument("--inplace", action="store_true", help="sw.runtime.InPlace: the survivors keep their processes")
    args = p.parse_args()
    if args.inplace:
        return in_place(args)
    env = sw.init()  # (the group's own setup may take long on a loaded machine: not the hang threshold)
    fit = et.LAYOUT.at(env)
    pipe = pipeline(fit, args)
    info = sw.checkpoint.resume(args.out / "ckpt", pipe)
    if info is None and env.world_size < args.start_world:
        time.sleep(et.HOLD_S)  # a machine is still starting: its arrival restarts this one at full size
        return 1
    run = [uuid.uuid4().hex[:8] if env.rank == 0 else ""]
    dist.broadcast_object_list(run, src=0)
    start = 0 if info is None else info.step
    if info is not None:
        if args.keep_resumed and not (args.out / "resumed" / f"w{env.world_size}-s{start}").exists():
            sw.checkpoint.save(args.out / "resumed" / f"w{env.world_size}-s{start}", pipe, step=start)
        source = "snapshots" if "snapshots" in info.reason else "checkpoint"
        row = {"step": start, "world": env.world_size, "source": source, "run": run[0], "time": time.time()}
        et.record(env, args.out / "resumes.jsonl", row)
    batch = et.LAYOUT.batch
    for step in range(start + 1, args.max_steps + 1):
        x, y = mdl.lm_data(batch, seed=100 + step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        samples = [batch * (step - 1), batch * step]
        row = {"step": step, "world": env.world_size, "time": time.time(), "samples": samples, "loss": loss}
        row["committed"] = pipe.committed_step
        et.record(env, args.out / "steps.jsonl", {**row, "run": run[0]})
        if args.save_every and step % args.save_every == 0:
            sw.checkpoint.save(args.out / "ckpt", pipe, step=step, keep=2)
    return 0


def pipeline(fit: Any, args: argparse.Namespace) -> sw.Pipeline:
    return sw.Pipeline(
        et.layers(), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=fit.microbatches, parallel=fit.parallel,
        seed=et.SEED, optimizer=et.adamw, snapshot=sw.Snapshots(every=args.every) if args.every else None,
        timeout=args.timeout,
    )  # fmt: skip


def in_place(args: argparse.Namespace) -> int:
    """The same job under ``sw.runtime.InPlace`` (``stagewise run --in-place``): a run is a generation; the first
    member of each writes the rows."""
    if not hasattr(sw.runtime, "InPlace"):
        raise SystemExit("--inplace needs sw.runtime.InPlace (the in-place recovery path of issue 48, item 3)")
    rank = int(os.environ["RANK"])
    batch = et.LAYOUT.batch

    last: dict[str, Any] = {}  # the snapshots' record as of the last step (its committed step at a failure)

    def resumed(job: Any) -> None:
        world, restored = len(job.members), time.time()  # (the save below is the benchmark's, for its replay)
        before = getattr(last.get("end"), "committed", None)  # what the failed generation knew committed last
        if args.keep_resumed and not (args.out / "resumed" / f"w{world}-s{job.step}").exists():
            sw.checkpoint.save(args.out / "resumed" / f"w{world}-s{job.step}", job.pipe, step=job.step)
        row = {"step": job.step, "world": world, "source": "snapshots", "run": f"g{job.generation}"}
        row["committed_before"] = before
        if job.recoveries:  # where this survivor's recovery went (the benchmark's breakdown; a newcomer has none)
            row.update(seconds=job.recoveries[-1].seconds, parts=job.recoveries[-1].parts)
        write(job, args.out / "resumes.jsonl", {**row, "restored": restored, "time": time.time()})
        if job.recoveries:  # every member's own view: how each member was counted, what its probes got
            done = job.recoveries[-1]
            mine = {"id": job.me, "gen": job.generation, "cause": done.cause, "time": time.time()}
            mine["committed_before"] = before
            with open(args.out / "recoveries.jsonl", "a") as f:
                f.write(json.dumps({**mine, "parts": done.parts, "evidence": getattr(done, "evidence", {})}) + "\n")

    def write(job: Any, path: Path, row: dict[str, object], second: str = "") -> None:
        """The first member writes ``path``; with ``second``, the last member writes that file too (in the
        benchmarks another machine's: ids are claimed machine by machine), so that a row survives the loss of the
        first's machine (benchmarks/recovery/lineage.py)."""
        mine = path if job.members and job.members[0] == rank else None
        if second and len(job.members) > 1 and job.members[-1] == rank:
            mine = path.with_name(second)
        if mine is not None:
            with open(mine, "a") as f:
                f.write(json.dumps(row) + "\n")

    job = sw.runtime.InPlace(et.LAYOUT, lambda fit: pipeline(fit, args), checkpoints=args.out / "ckpt",
                     timeout=args.timeout, after_recovery=resumed)  # fmt: skip
    job.start()
    if job.generation > 0:  # a machine taken back joins a running job: where the members are (after_recovery)
        resumed(job)
    read = [0.0]  # the longest live stand-still written so far (silences.jsonl)
    for step, loss in job.run(args.max_steps, lambda s: mdl.lm_data(batch, seed=100 + s)):
        if job.live_silence_s >= read[0] + 0.1:
            read[0] = job.live_silence_s
            with open(args.out / "silences.jsonl", "a") as f:
                f.write(json.dumps({"id": job.me, "gen": job.generation, "step": step, "time": time.time(),
                                    "s": read[0], "silence_s": job.silence_s}) + "\n")  # fmt: skip
        row = {
            "step": step,
            "world": len(job.members),
            "time": time.time(),
            "samples": [batch * (step - 1), batch * step],
            "committed": job.pipe.committed_step,  # every rank's snapshot held on two machines (the step before)
        }
        if job.pipe.snapshots is not None:  # (--every 0, the chaos benchmark's fault-free jobs without snapshots)
            last["end"] = job.pipe.snapshots.end  # (its record, not the pipeline: that one goes at a failure)
        write(job, args.out / "steps.jsonl", {**row, "loss": loss, "run": f"g{job.generation}"}, "steps.last.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
