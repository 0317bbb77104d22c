"""An elastic float64 job: pp 2 and data parallelism over whatever is left, resumed from peer snapshots.

    PYTHONPATH=tests stagewise run -n 2 --nnodes 2:3 --max-restarts 3 --rdzv-endpoint HOST:PORT [--rdzv-host] \
        tests/system/scripts/elastic_train.py --out DIR --steps 30 --every 2 --save-every 8 --holds 15@6,22@4

The layout follows the world size (``sw.ElasticLayout(pp=2, batch=24, microbatch_size=2)``: 2, 4, 6, 8,
12 or 24 processes), the global batch of step ``s`` is drawn from seed ``100 + s`` at every size, and
``sw.checkpoint.resume`` brings back the newest state among the peers' snapshots (``--every``) and the
checkpoints on disk (``--save-every``). What a test reads, in DIR:

* ``losses.jsonl``: one line per step trained (rank 0): step, loss, world size, attempt;
* ``resumed/w<W>-s<S>``: the state right after each resume (a checkpoint, saved by the resumed job), and
  ``trace/step-S/rank-R.pt``: each rank's state at each ``--trace`` step, as the job that trained it had it
  (written before anything else of the step's end, so a stalled rank has written it);
* ``hold-<S>-w<W>-r<R>``: rank R reached step S at world W (``--holds S@W,...``), its snapshot of S (if
  any) copied; it then waits for ``go-<S>-w<W>`` - or for its agent to stop it (the test kills a machine, or
  starts one);
* ``resumes.jsonl``: each resume's step, source and world (rank 0); ``--start-world W``: a fresh start at
  fewer processes waits to be restarted with W (the first rendezvous may close before every machine is up).

``--reference DIR``: instead, a fresh job of this world size started from the checkpoint DIR (a
``resumed/...`` state), training the steps after it with snapshots off: the reference for the losses
after a change of size. ``--no-snapshots``: the same job with disk checkpoints only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import stagewise as sw
from helpers import models as mdl

LAYOUT = sw.ElasticLayout(pp=2, batch=24, microbatch_size=2)
SEED = 5
HOLD_S = 300.0  # a hold that nobody ends fails the job rather than hang it


def layers() -> list[sw.Layer]:
    return mdl.lm(4)


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--holds", default="")
    p.add_argument("--trace", default="", help="steps whose state is saved under DIR/trace")
    p.add_argument("--start-world", type=int, default=0)
    p.add_argument("--reference", type=Path, default=None)
    p.add_argument("--no-snapshots", action="store_true")
    p.add_argument("--stall-save", default="", help="STEP@MACHINE: that machine's ranks stop inside that save")
    p.add_argument("--stall-snapshot", default="", help="STEP@MACHINE: ... inside the copy of that snapshot")
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    env = sw.init(timeout=args.timeout)
    fit = LAYOUT.at(env)  # every size the job may take (stagewise run --nnodes MIN:MAX) checked at the start
    snapshot = None if args.no_snapshots or args.reference else sw.Snapshots(every=args.every)
    pipe = sw.Pipeline(
        layers(), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=fit.microbatches, parallel=fit.parallel,
        seed=SEED, optimizer=adamw, snapshot=snapshot, timeout=args.timeout,
    )  # fmt: skip
    if args.reference is not None:
        return reference(pipe, env, args)
    info = sw.checkpoint.resume(args.out / "ckpt", pipe)
    start = 0 if info is None else info.step
    if info is None and env.world_size < args.start_world:
        time.sleep(HOLD_S)  # a machine is still starting: its agent's arrival restarts this one at full size
        return 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if info is not None:
        tag = args.out / "resumed" / f"w{env.world_size}-s{start}"
        if not (tag / f"step-{start:08d}").exists():  # (a round that failed to start resumed here already)
            sw.checkpoint.save(tag, pipe, step=start)
        source = "snapshots" if "snapshots" in info.reason else "checkpoint"
        record(env, args.out / "resumes.jsonl", {"step": start, "world": env.world_size, "source": source})
    else:
        stall(args)  # (the first run only)
    holds = {tuple(map(int, s.split("@"))) for s in args.holds.split(",") if s}  # (step, world)
    trace = {int(s) for s in args.trace.split(",") if s}
    for step in range(start + 1, args.steps + 1):
        x, y = mdl.lm_data(LAYOUT.batch, seed=100 + step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        row = {"step": step, "loss": loss, "world": env.world_size, "attempt": attempt, "time": time.time()}
        record(env, args.out / "losses.jsonl", row)
        if step in trace:
            dump(pipe, env, args.out / "trace" / f"step-{step}")
        if step % args.save_every == 0 or step == args.steps:
            sw.checkpoint.save(args.out / "ckpt", pipe, step=step, keep=2)
        if (step, env.world_size) in holds:
            hold(pipe, env, args.out, step)
    return 0


def dump(pipe: sw.Pipeline, env: sw.runtime.Env, folder: Path) -> None:
    """This rank's parameters, buffers and optimizer state by one-process name (``torch.save``, no collective:
    a machine about to be lost need not wait for the others)."""
    tensors = {f"model/{n}": t.detach().clone() for n, t in pipe.state_dict().items()}
    names = {id(p): n for n, p in pipe.named_parameters()}
    for opt in pipe.optimizers.values():
        for p, entries in opt.state.items():
            tensors.update({f"optim/{names[id(p)]}/{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, folder / f".rank-{env.rank}.tmp")
    os.replace(folder / f".rank-{env.rank}.tmp", folder / f"rank-{env.rank}.pt")


def hold(pipe: sw.Pipeline, env: sw.runtime.Env, out: Path, step: int) -> None:
    """This rank's snapshot copied, then wait for the test's word."""
    if pipe.snapshots is not None:
        pipe.snapshots.wait()
    (out / f"hold-{step}-w{env.world_size}-r{env.rank}").touch()
    go = out / f"go-{step}-w{env.world_size}"
    deadline = time.monotonic() + HOLD_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"nobody ended the hold at step {step}")
        time.sleep(0.1)


def stall(args: argparse.Namespace) -> None:
    """``--stall-save`` / ``--stall-snapshot STEP@MACHINE``: on that machine (torchrun's GROUP_RANK), this rank stops
    in the middle of the checkpoint save of STEP (its share written) or of the copy of STEP's snapshot to the
    next machine (its own file written), leaves ``saving-STEP-r<R>`` / ``copying-STEP-r<R>``, and waits to be
    killed with its machine."""
    machine = os.environ.get("GROUP_RANK")
    rank = os.environ.get("RANK")
    if args.stall_save and args.stall_save.split("@")[1] == machine:
        from stagewise.runtime.checkpoint import api

        step = int(args.stall_save.split("@")[0])
        written = api.storage.save_tensors

        def save_tensors(tensors: object, folder: Path, *rest: object) -> None:
            written(tensors, folder, *rest)  # type: ignore[arg-type]
            if folder.name == f".step-{step:08d}.tmp" and folder.parent.name == "ckpt":
                (args.out / f"saving-{step}-r{rank}").touch()
                time.sleep(HOLD_S)

        api.storage.save_tensors = save_tensors  # type: ignore[assignment]
    if args.stall_snapshot and args.stall_snapshot.split("@")[1] == machine:
        from stagewise.runtime.elastic import snapshot_copies
        from stagewise.runtime.elastic.snapshot_file import read_header

        step = int(args.stall_snapshot.split("@")[0])
        send = snapshot_copies.send  # (the helper's copy to the next machine, after its own file)

        def stalled(snap: object, head: bytes, payload: torch.Tensor, *rest: object) -> None:
            if read_header(head)[0]["step"] == step:
                traced = args.out / "trace" / f"step-{step}" / f"rank-{rank}.pt"
                while str(step) in args.trace.split(",") and not traced.exists():  # the step's end on the main thread
                    time.sleep(0.05)
                (args.out / f"copying-{step}-r{rank}").touch()
                time.sleep(HOLD_S)
            send(snap, head, payload, *rest)  # type: ignore[arg-type]

        snapshot_copies.send = stalled  # type: ignore[assignment]


def reference(pipe: sw.Pipeline, env: sw.runtime.Env, args: argparse.Namespace) -> int:
    """A fresh job of this size from the state in ``args.reference``: the steps after it, losses to a file."""
    assert args.reference is not None
    info = sw.checkpoint.load(args.reference, pipe)
    for step in range(info.step + 1, args.steps + 1):
        x, y = mdl.lm_data(LAYOUT.batch, seed=100 + step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        record(env, args.out / f"reference-{args.reference.name}.jsonl", {"step": step, "loss": loss})
    return 0


def record(env: sw.runtime.Env, path: Path, row: dict[str, object]) -> None:
    if env.rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
