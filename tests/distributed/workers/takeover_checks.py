"""A recovery's re-layout on 4 gloo ranks (checks of relayout_checks' job): the survivors' new stages take each
tensor from a live survivor or from a snapshot file a survivor holds (runtime/relayout/takeover.py), exact
against a fresh job of the new layout loaded from a checkpoint of the committed state.

Two machines are emulated: ranks 0 and 2 on machine "0", 1 and 3 on machine "1", each machine with its own
snapshot folder (rank j of one machine copies its snapshots to rank j of the other). The loss of ranks 2 and 3
is emulated: they take part in the exchange (the world stays 4 processes) but hold nothing and build nothing.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stagewise as sw
from relayout_checks import _group, assert_same, build, folder, relaid, state_of, train, warmup
from stagewise.runtime.comm import snapshot_wire
from stagewise.runtime.relayout.takeover import hold, take_over
from worker import Ctx, raises

STEPS = 2
OLD = [1, 2, 3, 2]  # the old layout's cut: BatchNorm (layer 2) on rank 1, a survivor
SCHEDULED = {"lr_scheduler": warmup}  # a learning rate that changes every step: carried by the take-over


def machine_root(tag: str, rank: int) -> Path:
    return folder(tag) / f"machine{rank % 2}"


def snapshotted(ctx: Ctx, tag: str, group: Any = None, **layout: Any) -> Any:
    """A pipeline whose snapshots go to this rank's machine's folder (the machine and the folder are read from
    the environment as it is built, as on a real machine: the options stay the same on every rank)."""
    os.environ["GROUP_RANK"] = str(ctx.rank % 2)
    os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(machine_root(tag, ctx.rank))
    return build(group, snapshot=1, **SCHEDULED, **layout)


def lose(ctx: Ctx, pipe: Any, survivors: tuple[int, ...]) -> Any:
    """The old pipeline goes on every rank (its last snapshot finished first, its end not marked); a survivor
    keeps its tensors (:func:`hold`), a lost rank nothing."""
    pipe.snapshots.wait()
    held = hold(pipe) if ctx.rank in survivors else None
    pipe.snapshots.forget()
    del pipe
    gc.collect()
    dist.barrier()
    return held


def recovered(ctx: Ctx, tag: str, held: Any, ckpt: Path) -> dict[str, Any]:
    """The survivors (0, 1) build pp 2 and take over; compared with a fresh pp 2 job loaded from ``ckpt``."""
    members = [0, 1]
    new_group = _group(members, ctx.world)
    lost = dist.new_group([2, 3])
    if ctx.rank in members:
        new = snapshotted(ctx, tag, new_group)
    else:  # a snapshot group is made by every process of the world at once (snapshot_wire.snapshot_group)
        new = None
        snapshot_wire.snapshot_group(lost, 60.0)
    done = take_over(new, held, None, 60.0)
    counts = [None] * ctx.world
    dist.all_gather_object(counts, (done.step, done.counts))
    assert all(c == counts[0] for c in counts), f"{tag}: the processes disagree on the sources: {counts}"
    out: dict[str, Any] = {"step": done.step, "counts": done.counts, "compared": 0}
    fresh_group = _group(members, ctx.world)  # (made just before its build: it takes the tied group made ahead)
    if new is not None:
        own = set(held.live.get(str(done.step), ())) if held is not None else set()
        params = {f"model/{n}": p for n, p in new.state_dict(keep_vars=True).items()}
        aliased = [n for n in own if n in params and params[n].data_ptr() == held.tensors[n].data_ptr()]
        assert sorted(aliased) == sorted(n for n in own if n in params), f"{tag}: kept tensors copied, not aliased"
        out["aliased"] = len(aliased)
        fresh = build(fresh_group, **SCHEDULED)
        sw.checkpoint.load(ckpt, fresh)
        out["compared"] = assert_same(state_of(new), state_of(fresh), tag)
        losses, want = train(new, STEPS), train(fresh, STEPS)
        assert losses == want, f"{tag}: losses {losses} after the take-over, {want} from the checkpoint"
        new.snapshots.wait()
        new.snapshots.forget()
    dist.barrier()
    return out


def check_snapshot_sources(ctx: Ctx) -> dict[str, Any]:
    """4 -> 2 after ranks 2 and 3 are lost, machine "1"'s memory wiped: rank 0's own stage kept (aliased); rank
    1's stage moved live to rank 0 but for one parameter rank 1 wrote in place after the committed snapshot (read
    from its copy on machine "0" where rank 0 needs it); the lost ranks' stages from the files machine "0"
    holds, read there by rank 0 and sent to rank 1."""
    tag = "takeover-loss"
    pipe = snapshotted(ctx, tag, partition=OLD)
    train(pipe, 0)
    sw.checkpoint.save(folder(tag) / "ckpt", pipe, step=STEPS)
    if ctx.rank == 1:
        with torch.no_grad():  # its optimizer stepped this one in the failed step: no longer the committed value
            next(pipe.parameters()).add_(1.0)
    norms = [m for m in pipe.modules() if isinstance(m, nn.BatchNorm1d)] if ctx.rank in (0, 1) else []
    for norm in norms:  # the failed step's forward ran here: BatchNorm wrote its statistics (no version counted)
        norm(torch.randn(4, norm.num_features, dtype=torch.float64))
    held = lose(ctx, pipe, (0, 1))
    if ctx.rank == 1:
        shutil.rmtree(machine_root(tag, 1))  # machine "1"'s folder lost: rank 1 gets the lost stages sent
    dist.barrier()
    out = recovered(ctx, tag, held, folder(tag) / "ckpt")
    out["norms"] = len(norms)
    c = out["counts"]
    assert out["step"] == STEPS and c["kept"] > 0 and c["live"] > 0 and c["snapshot"] > 0, out
    assert out["norms"] == (1 if ctx.rank == 1 else 0), out
    if ctx.rank in (0, 1):
        assert out["compared"] > 0, out
    return out


def check_past_commit(ctx: Ctx) -> dict[str, Any]:
    """A death mid-step: every rank finished step 3, but the lost ranks' snapshots of it never reached a
    machine, so step 2 is the committed one; the survivors' live tensors are step 3's (parameters, Adam's state,
    BatchNorm's statistics): every tensor comes from step 2's snapshot files, none live."""
    tag = "takeover-past"
    pipe = snapshotted(ctx, tag, partition=OLD)
    train(pipe, 0)
    sw.checkpoint.save(folder(tag) / "ckpt", pipe, step=STEPS)
    train(pipe, STEPS, 1)
    held = lose(ctx, pipe, (0, 1))
    if ctx.rank in (0, 1):
        for path in machine_root(tag, ctx.rank).rglob(f"{STEPS + 1:010d}-*-r0000[23].snap"):
            path.unlink()  # the lost ranks' step-3 files, own and copied
    dist.barrier()
    out = recovered(ctx, tag, held, folder(tag) / "ckpt")
    assert out["step"] == STEPS and out["counts"]["kept"] == 0 and out["counts"]["live"] == 0, out
    return out


def check_shrink_snapshots(ctx: Ctx) -> dict[str, Any]:
    """``pipe.relayout`` onto fewer processes with ``snapshot=``: the members' snapshot group is made ahead by the
    whole world (the retiring ranks build nothing, so a group gathered over the world would wait for them until
    the timeout); the snapshots go on from the step, and the losses equal a fresh job's from a checkpoint."""
    tag = "shrink-snapshots"
    pipe = snapshotted(ctx, tag)
    train(pipe, 0)
    pipe.snapshots.wait()
    out = relaid(pipe, ctx, tag, STEPS, [0, 1], make=lambda g, bn, **lay: build(g, bn, **SCHEDULED, **lay))
    if ctx.rank in (0, 1):
        snaps = pipe.snapshots
        assert snaps is not None, f"{tag}: rank {ctx.rank} lost its snapshotter in the re-layout"
        snaps.wait()  # the steps after the re-layout were snapshotted over the members' group
        out["snapshot_step"] = snaps.step
        assert snaps.step == 2 * STEPS, f"{tag}: snapshots at step {snaps.step}, expected {2 * STEPS}"
        snaps.forget()
    dist.barrier()
    return out


def check_relayout_from_snapshots(ctx: Ctx) -> dict[str, Any]:
    """``pipe.relayout([0, 1], live=[0, 1])``: ranks 2 and 3 give nothing live, so their stages come from the
    current step's snapshot files (machine "0"'s read by rank 0 on it, machine "1"'s by rank 1), exact against a
    fresh job loaded from a checkpoint; without a snapshot of the current step the same call is refused alike,
    by name, before anything moves."""
    tag = "relayout-snapshots"
    pipe = snapshotted(ctx, tag)
    train(pipe, 0)
    pipe.snapshots.wait()
    plain = build()  # no snapshot=: live= has nowhere to take the other ranks' tensors from
    refused = raises(
        ValueError,
        ["live= leaves tensors to the snapshot files", "snapshot= off"],
        lambda: plain.relayout([0, 1], live=[0, 1]),
    )
    out = relaid(pipe, ctx, tag, STEPS, [0, 1], live=[0, 1], make=lambda g, bn, **lay: build(g, bn, **SCHEDULED, **lay))
    if ctx.rank in (0, 1):
        assert out["compared"] > 0, out
        pipe.snapshots.wait()
        pipe.snapshots.forget()
    dist.barrier()
    return {**out, "refused": refused}


CHECKS = {
    "relayout-from-snapshots": check_relayout_from_snapshots,
    "snapshot-sources": check_snapshot_sources,
    "past-commit": check_past_commit,
    "shrink-snapshots": check_shrink_snapshots,
}
