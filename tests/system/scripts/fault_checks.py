"""One rank of a pipeline that loses a rank mid-step, started as a plain process (no torchrun).

    python fault_checks.py --rank R --world N --port P --victim V --out DIR [--hang] [--job NAME]

The test hosts the c10d TCPStore, so the store outlives any rank, and starts
every rank itself, so it sees each survivor's own report rather than torchrun
tearing the job down. Step 0 runs normally (shapes are learned); in step 1 the
victim rank calls ``os._exit(17)`` from a layer's forward on micro-batch 2
(with ``--hang``, it sleeps there instead, and the others time out).
Each survivor must raise :class:`~stagewise.PipelineError` within the pipeline's
timeout; it writes the message to ``DIR/rankR.txt`` and exits 1.

The pipeline's error board is the test's store itself (``store=``), shared by
every job the test starts; each job's process group lives under its own
prefix (``--job``). With ``--victim -1`` no rank fails: the job trains two
steps and writes its losses (``ok <loss0> <loss1>``), exit 0 (its timeout is
long: nothing fails, and a loaded machine must not make it) - a clean job
on a store that outlived a failed one must not read the old job's failure.

With ``--mesh`` the ranks form ``pp=2 x dp=N/2`` and the victim *raises* in
its forward instead (then stays alive, its connections open, until killed):
the ranks of the other pipeline, which only meet it in the data-parallel
all-reduce, must learn of its error from the mesh's shared error board.

With ``--run-id ID`` the ranks join as torchrun's workers do with an agent
store: ``stagewise.init`` with ``TORCHELASTIC_RUN_ID=ID``, restart count 0 and
``TORCHELASTIC_USE_AGENT_STORE=True`` on the test's store, and the pipeline's
board on the default store - a job that reuses an earlier job's run id and
attempt on a store that outlived it. With ``--refused`` every rank fails at
once, after one step: it loads a checkpoint that is not there (the same
CheckpointError everywhere), uncaught, with a pipeline timeout of 600 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw

D, CLASSES, M = 8, 3, 4
TIMEOUT = 5.0
VICTIM_EXIT = 17


class Tripwire(nn.Module):
    """Identity, except that on the armed rank its ``fire_at``-th training forward ends the process."""

    armed = False
    hang = False
    raises = False
    fire_at = -1
    calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if Tripwire.armed and torch.is_grad_enabled():
            if Tripwire.calls == Tripwire.fire_at:
                sys.stderr.flush()
                if Tripwire.hang:
                    time.sleep(3600)  # stuck in compute: the others time out; the test kills this rank
                if Tripwire.raises:
                    raise ValueError("the tripwire fired")
                os._exit(VICTIM_EXIT)
            Tripwire.calls += 1
        return h


def layers(world: int) -> list[sw.Layer]:
    out: list[sw.Layer] = []
    for _ in range(world):  # one stage per rank under 1f1b: linear, tanh, tripwire
        out += [sw.Layer(nn.Linear, D, D, dtype=torch.float64), sw.Layer(nn.Tanh), sw.Layer(Tripwire)]
    return out + [sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64)]


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--victim"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hang", action="store_true", help="the victim sleeps instead of exiting")
    parser.add_argument("--mesh", action="store_true", help="pp=2 x dp=world/2; the victim raises")
    parser.add_argument("--job", default="job", help="prefix of this job's process group in the store")
    parser.add_argument("--run-id", default=None, help="join as torchrun's workers do, with this run id")
    parser.add_argument("--refused", action="store_true", help="every rank fails at once (a missing checkpoint)")
    parser.add_argument("--relayout", action="store_true", help="the victim is killed during a pipe.relayout()")
    parser.add_argument("--resume", type=Path, default=None, help="a clean job loads this checkpoint first")
    parser.add_argument(
        "--watch", choices=("dies", "raises"), default=None, help="the victim leads a Replanner's watch and fails in it"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = join(args)
    stages = 2 if args.mesh else args.world
    partition = [3] * (stages - 1) + [4]
    parallel = sw.ParallelConfig(pp=2, dp=args.world // 2) if args.mesh else None
    timeout = 600.0 if args.refused else TIMEOUT if args.victim >= 0 else 60.0
    adam = (lambda params: torch.optim.Adam(params, lr=0.05)) if args.relayout else None  # state to resume
    pipe = sw.Pipeline(
        layers(stages), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, partition=partition,
        parallel=parallel, timeout=timeout, store=store, optimizer=adam,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = 4 * M * (1 if parallel is None else args.world // 2)  # each replica a share of its own (equal ones: refused)
    x, y = torch.randn(rows, D, dtype=torch.float64, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)
    x, y = pipe.local_batch(x, y)
    if args.refused:
        pipe.train_step(x, y)
        sw.checkpoint.load(args.out / "nowhere", pipe)  # every rank raises alike; the exit hook takes it
    if args.victim < 0:  # a clean job: two steps, losses reported
        try:
            if args.resume is not None:
                sw.checkpoint.load(args.resume, pipe)
            losses = [pipe.train_step(x, y) for _ in range(2)]
            text, code = "ok " + " ".join(repr(v) for v in losses), 0
        except BaseException:
            text, code = traceback.format_exc(), 3
        (args.out / f"rank{args.rank}.txt").write_text(text)
        sys.stdout.flush()
        os._exit(code)
    pipe.train_step(x, y)
    if args.relayout:
        killed_in_relayout(pipe, args, x, y)
    if args.watch:
        failed_in_the_watch(pipe, args, x, y)
    Tripwire.armed, Tripwire.fire_at = args.rank == args.victim, 2  # the third forward: micro-batch 2
    Tripwire.hang, Tripwire.raises = args.hang, args.mesh
    started = time.perf_counter()
    text, code = outcome(lambda: pipe.train_step(x, y), "no error: the step completed")
    text += f"\n(after {time.perf_counter() - started:.2f} s on {type(pipe.transport).__name__})"
    report(args, text)
    if args.mesh and args.rank == args.victim:
        time.sleep(3600)  # alive, connections open: the others must not rely on a closed socket
    os._exit(code)  # no teardown: the process group has a dead member


def state_of(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    """The rank's parameters, buffers, Adam state (its step too) and steps trained, by name."""
    out = {f"model/{k}": v.detach().clone() for k, v in pipe.state_dict().items()}
    names = {id(p): n for n, p in pipe.named_parameters()}
    for opt in pipe.optimizers.values():
        for param, entries in opt.state.items():
            out |= {f"optim/{names[id(param)]}/{k}": torch.as_tensor(v).clone() for k, v in entries.items()}
    return out | {"train_steps": torch.tensor(pipe.train_steps)}


def reference(pipe: sw.Pipeline, x: Any, y: Any, out: Path, rank: int) -> None:
    """Save the state from before the re-layout (``out/before``), train two steps from it (their losses, what a
    resume of that checkpoint must give: ``out/rankR-reference.txt``), and load it back."""
    sw.checkpoint.save(out / "before", pipe, step=pipe.train_steps)
    losses = [pipe.train_step(x, y) for _ in range(2)]
    sw.checkpoint.load(out / "before", pipe)
    (out / f"rank{rank}-reference.txt").write_text(" ".join(repr(v) for v in losses))


def killed_in_relayout(pipe: sw.Pipeline, args: argparse.Namespace, x: Any, y: Any) -> None:
    """The victim posts its re-layout transfers and dies (``os._exit``: nothing posted on any board); each other
    rank reports its error, whether its pipeline still holds the layout from before the call and its state
    from before, to the bit (parameters, Adam's state, steps trained: nothing half-moved)."""
    wire = sw.runtime.comm.relayout_wire

    def dies(ops: Any, group: Any, wait: Any) -> None:
        for kind, tensor, peer in ops:
            (dist.isend if kind == "send" else dist.irecv)(tensor, peer, group=group)
        os._exit(VICTIM_EXIT)

    reference(pipe, x, y, args.out, args.rank)
    if args.rank == args.victim:
        wire.post = dies
    ranges = [(r.start, r.stop) for r in pipe.layer_ranges]
    before = state_of(pipe)
    started = time.perf_counter()
    relaid = lambda: pipe.relayout(partition=[4] + [3] * (args.world - 2) + [3])  # noqa: E731
    text, code = outcome(relaid, "no error: the re-layout completed")
    kept = [(r.start, r.stop) for r in pipe.layer_ranges] == ranges
    after = state_of(pipe)
    whole = sorted(after) == sorted(before) and all(torch.equal(after[k], v) for k, v in before.items())
    text += f"\n(state unchanged: {whole and len(before) > 0})"
    text += f"\n(after {time.perf_counter() - started:.2f} s; the layout from before kept: {kept})"
    report(args, text)
    os._exit(code)


def failed_in_the_watch(pipe: sw.Pipeline, args: argparse.Namespace, x: Any, y: Any) -> None:
    """Rank 0 (the victim) leads a Replanner's watch of the run and fails in it at the first step watched: it
    dies (``os._exit``: nothing posted) or raises. Each other rank, which sent its events and waits for the lead's
    word, reports its error: a PipelineError naming rank 0, within the deadline (at once when the lead could say
    why)."""
    from stagewise.runtime import Replanner

    replanner = Replanner(pipe, steps=100)
    assert replanner.lead is not None, "the pipeline's ranks are the job: rank 0 leads the watch"
    if args.rank == args.victim:

        def fails(*_: Any) -> None:
            if args.watch == "raises":
                raise RuntimeError("the watch broke")
            os._exit(VICTIM_EXIT)

        replanner._observe = fails  # type: ignore[method-assign]
    started = time.perf_counter()
    text, code = outcome(lambda: (pipe.train_step(x, y), replanner.observe()), "no error: the watch completed")
    report(args, text + f"\n(after {time.perf_counter() - started:.2f} s)")
    os._exit(code)


def outcome(run: Callable[[], object], done: str) -> tuple[str, int]:
    """How ``run()`` ended, as a rank reports it: ``done`` and 2 (it completed), the PipelineError and 1, or the
    traceback of anything else and 3."""
    try:
        run()
        return done, 2
    except sw.PipelineError as err:
        return f"PipelineError: {err}", 1
    except BaseException:
        return traceback.format_exc(), 3


def report(args: argparse.Namespace, text: str) -> None:
    """This rank's report: its file for the test, and its stderr."""
    (args.out / f"rank{args.rank}.txt").write_text(text)
    sys.stderr.write(f"rank {args.rank}: {text}\n")
    sys.stderr.flush()


def join(args: argparse.Namespace) -> dist.TCPStore | None:
    """Join the job's process group on the test's store; the store for the pipeline's board (None: the default
    store, as under torchrun)."""
    wait = timedelta(seconds=30)
    if args.run_id is not None:
        os.environ.update(
            RANK=str(args.rank), WORLD_SIZE=str(args.world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(args.port), TORCHELASTIC_RUN_ID=args.run_id, TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
        )  # fmt: skip
        sw.init("gloo", timeout=30.0)
        return None
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False, timeout=wait)
    job_store = dist.PrefixStore(f"{args.job}/", store)
    dist.init_process_group("gloo", store=job_store, rank=args.rank, world_size=args.world, timeout=wait)
    return store


if __name__ == "__main__":
    main()
