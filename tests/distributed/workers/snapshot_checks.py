"""``snapshot=`` on 4 gloo ranks: what a snapshot holds, resuming from it at the same and another layout, from a
peer machine's copy, past a damaged file, and what is refused.

    torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks snapshot_checks --out DIR

Each check trains a pipeline ``a`` with snapshots, then builds a fresh pipeline ``b`` (another seed, so
nothing is equal by chance) and resumes it with ``sw.checkpoint.resume``; float64, AdamW, dropout. Two
"machines" are made by hand where a check needs them: ``GROUP_RANK`` (torchrun's agent rank, which the
snapshots read) and a snapshot folder per machine.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime.elastic import snapshots as snapshots_module
from worker import Check, Ctx, gather_objects, raises, refused

BATCH = 8


def layers() -> list[sw.Layer]:
    lm = mdl.lm(4)
    return [lm[0], sw.Layer(nn.Dropout, 0.2), *lm[1:]]


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def folder(ctx: Ctx, name: str) -> Path:
    """A fresh folder per check, alike on every rank (made empty by rank 0)."""
    path = Path(os.environ.get("STAGEWISE_SNAPSHOT_TEST_DIR", "/tmp/sw-snapshots")) / name
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def pipe(parallel: Any = None, seed: int = 3, snapshot: Any = 2, **extra: Any) -> sw.Pipeline:
    parallel = parallel if parallel is not None else sw.ParallelConfig(pp=2, dp=2)
    return sw.Pipeline(
        layers(), loss_fn=mdl.lm_loss, microbatches=2, seed=seed, optimizer=adamw, parallel=parallel,
        snapshot=snapshot, timeout=60, **extra,
    )  # fmt: skip


def train(p: sw.Pipeline, steps: range) -> list[float]:
    out = []
    for step in steps:
        x, y = mdl.lm_data(BATCH, seed=100 + step)
        out.append(p.train_step(*p.local_batch(x, y)))
    return out


def state(p: sw.Pipeline) -> dict[str, torch.Tensor]:
    """This rank's parameters, buffers and optimizer state by one-process name, copied."""
    out = {f"model/{n}": t.detach().clone() for n, t in p.state_dict().items()}
    names = {id(q): n for n, q in p.named_parameters()}
    for opt in p.optimizers.values():
        for q, st in opt.state.items():
            for k, v in st.items():
                out[f"optim/{names[id(q)]}/{k}"] = torch.as_tensor(v).clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> int:
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b)))
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, (what, different)
    return len(a)


def decay(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def seeded(ctx: Ctx) -> None:
    torch.manual_seed(1000 + ctx.rank)  # dropout's stream, per rank


# ---- the checks ------------------------------------------------------------------------------------------
def same_layout(ctx: Ctx) -> dict[str, Any]:
    """pp 2 x dp 2: resumed from step 4's snapshot, step 5 is the uninterrupted run's to the bit (dropout:
    the generators come back), and so is the whole state after it."""
    root = folder(ctx, "same")
    seeded(ctx)
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root), extra=lambda: {"seen": 4 * BATCH}), lr_scheduler=decay)
    losses = train(a, range(1, 6))
    a.snapshots.wait()
    b = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)), lr_scheduler=decay)
    info = sw.checkpoint.resume(root / "ckpt", b)
    assert info is not None and info.step == 4 and info.rng_restored, info
    assert info.scheduler_saved and info.scheduler_restored, info  # lr_scheduler=: at step 4's position
    assert [s.last_epoch for s in b.schedulers.values()] == [4] * len(b.schedulers)
    assert info.extra == {"seen": 32} and "peer snapshots" in info.reason, info
    assert b.snapshots.step == 4
    again = train(b, range(5, 6))
    assert again == losses[4:], (again, losses)
    return {"compared": same(state(a), state(b), "after step 5"), "losses": losses}


def other_layout(ctx: Ctx) -> dict[str, Any]:
    """Snapshots of pp 2 x dp 2 resumed at pp 4 (the same 4 processes, another layout): every tensor by its
    one-process name, equal to the bit to what the saving ranks held; the generators are not restored."""
    root = folder(ctx, "other")
    seeded(ctx)
    a = pipe(snapshot=sw.Snapshots(every=3, folder=str(root)), lr_scheduler=decay)
    train(a, range(1, 4))
    a.snapshots.wait()
    saved: dict[str, torch.Tensor] = {}
    for held in gather_objects(state(a), None):
        saved.update(held)
    b = sw.Pipeline(
        layers(), loss_fn=mdl.lm_loss, microbatches=4, seed=9, optimizer=adamw, timeout=60,
        snapshot=sw.Snapshots(every=3, folder=str(root)),
    )  # fmt: skip
    info = sw.checkpoint.resume(root / "ckpt", b)
    assert info is not None and info.step == 3 and not info.rng_restored, info
    assert info.scheduler_saved and not info.scheduler_restored, info  # b has no lr_scheduler= to take it
    mine = state(b)
    same(mine, {k: saved[k] for k in mine}, "pp 4 from pp 2 x dp 2")
    la, lb = train(a, range(4, 5)), train(b, range(4, 5))  # dropout streams differ: close, not equal
    return {"names": len(mine), "loss": [la, lb]}


def machines(ctx: Ctx) -> dict[str, Any]:
    """Two machines (ranks 0-1, 2-3), each with its own folder: every snapshot is on its machine and on the
    other; with machine 1's folder gone for good, the pipeline resumes from machine 0's copies alone, bit-exact."""
    root = folder(ctx, "machines")
    machine = str(ctx.rank // 2)
    os.environ["GROUP_RANK"] = machine
    os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(root / f"m{machine}")
    try:
        seeded(ctx)
        a = pipe(snapshot=2)
        train(a, range(1, 5))
        a.snapshots.wait()
        dist.barrier()
        here = sorted(p.name for p in a.snapshots.folder.iterdir())
        owners = sorted({int(n.split("-r")[1][:5]) for n in here})
        steps = sorted({int(n[:10]) for n in here})
        assert owners == [0, 1, 2, 3] and steps == [2, 4], here  # its own and the other machine's
        want = state(a)
        dist.barrier()
        if ctx.rank == 2:
            shutil.rmtree(root / "m1")  # machine 1's memory is gone
        dist.barrier()
        b = pipe(seed=9, snapshot=2)
        info = sw.checkpoint.resume(root / "ckpt", b)
        assert info is not None and info.step == 4 and info.rng_restored, info
        return {"compared": same(want, state(b), "from the peer's copies"), "files": len(here)}
    finally:
        os.environ.pop("GROUP_RANK", None)
        os.environ.pop("STAGEWISE_SNAPSHOT_DIR", None)


def one_folder(ctx: Ctx) -> dict[str, Any]:
    """Two machines (ranks 0-1, 2-3) on one memory folder (two agents of one host, one STAGEWISE_SNAPSHOT_DIR):
    refused at construction on every rank alike, naming both machines and the way out."""
    root = folder(ctx, "one-folder")
    os.environ["GROUP_RANK"] = str(ctx.rank // 2)
    os.environ["STAGEWISE_SNAPSHOT_DIR"] = str(root)
    try:
        said = raises(ValueError, ["machines 0, 1 keep their snapshots in one folder", "STAGEWISE_SNAPSHOT_DIR"],
                      lambda: pipe(snapshot=2))  # fmt: skip
        return {"refused": said[:80]}
    finally:
        os.environ.pop("GROUP_RANK", None)
        os.environ.pop("STAGEWISE_SNAPSHOT_DIR", None)


def damaged(ctx: Ctx) -> dict[str, Any]:
    """A flipped byte in rank 2's newest snapshot, and rank 3's cut short - stage 1's two replicas: both refused
    (logged, never loaded), and the pipeline resumes from the generation before, exactly as it was. (With one
    replica's file whole, step 4 would be taken from it, without the generators' states.)"""
    root = folder(ctx, "damaged")
    seeded(ctx)
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root)))
    train(a, range(1, 3))
    a.snapshots.wait()
    at_two = state(a)
    train(a, range(3, 5))
    a.snapshots.wait()
    dist.barrier()
    if ctx.rank == 0:
        files = {int(p.name.split("-r")[1][:5]): p for p in a.snapshots.folder.glob("0000000004-*.snap")}
        data = bytearray(files[2].read_bytes())
        data[-5] ^= 0x40
        files[2].write_bytes(bytes(data))
        files[3].write_bytes(files[3].read_bytes()[:-100])
    dist.barrier()
    b = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)))
    info = sw.checkpoint.resume(root / "ckpt", b)
    assert info is not None and info.step == 2 and info.rng_restored, info
    return {"compared": same(at_two, state(b), "the generation before the damaged one")}


def disk_newer(ctx: Ctx) -> dict[str, Any]:
    """A checkpoint on disk newer than the newest snapshot wins (and an equal one does not)."""
    root = folder(ctx, "disk")
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root)))
    train(a, range(1, 3))
    sw.checkpoint.save(root / "ckpt", a, step=2)
    b = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)))
    tie = sw.checkpoint.resume(root / "ckpt", b)
    assert tie is not None and tie.step == 2 and "peer snapshots" in tie.reason, tie
    train(a, range(3, 4))
    a.snapshots.wait()
    sw.checkpoint.save(root / "ckpt", a, step=3)
    c = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)))
    info = sw.checkpoint.resume(root / "ckpt", c)
    assert info is not None and info.step == 3 and "complete checkpoint" in info.reason, info
    assert c.snapshots.step == 3
    d = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)))
    assert sw.checkpoint.load(root / "ckpt", d).step == 3 and d.snapshots.step == 3  # a plain load counts on too
    return {"compared": same(state(a), state(c), "from the newer checkpoint")}


def fresh(ctx: Ctx) -> None:
    """Nothing anywhere: resume returns None on every rank."""
    root = folder(ctx, "fresh")
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root)))
    assert sw.checkpoint.resume(root / "ckpt", a) is None


def copy_before_step(ctx: Ctx) -> dict[str, Any]:
    """The next step's optimizer waits for the copy: with the copy slowed down by 0.5 s, the snapshot of step 2
    still holds step 2's parameters, not step 3's (a snapshot taken without the wait would mix them)."""
    root = folder(ctx, "gate")
    fill = snapshots_module.fill_payload

    def slow(*args: Any) -> Any:
        time.sleep(0.5)
        return fill(*args)

    seeded(ctx)
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root)))
    snapshots_module.fill_payload = slow  # type: ignore[assignment]
    try:
        train(a, range(1, 3))
        at_two = state(a)
        train(a, range(3, 4))
        a.snapshots.wait()
    finally:
        snapshots_module.fill_payload = fill  # type: ignore[assignment]
    waited = a.snapshots.stats["gate_s"]
    b = pipe(seed=9, snapshot=sw.Snapshots(every=2, folder=str(root)))
    info = sw.checkpoint.resume(root / "ckpt", b)
    assert info is not None and info.step == 2, info
    compared = same(at_two, state(b), "step 2's snapshot")
    assert waited > 0.1, a.snapshots.stats  # the step did wait (the copy took 0.5 s)
    return {"compared": compared, "gate_s": waited}


def during_merge(ctx: Ctx) -> dict[str, Any]:
    """A snapshot due inside a gradient merge (no_sync()) waits for the step that ends it (a snapshot holds no
    partial gradients): none is taken at step 1, one at step 2; resumed from it, steps 3 (merged) and 4 are the
    uninterrupted run's to the bit, dropout masks included (their seed and step come back with the snapshot)."""
    root = folder(ctx, "merge")
    seeded(ctx)
    a = pipe(snapshot=sw.Snapshots(every=1, folder=str(root)))
    with a.no_sync():
        train(a, range(1, 2))
    a.snapshots.wait()
    assert a.snapshots.stats["snapshots"] == 0, a.snapshots.stats
    train(a, range(2, 3))
    a.snapshots.wait()
    assert a.snapshots.stats["snapshots"] == 1, a.snapshots.stats
    b = pipe(seed=9, dropout_seed=5, snapshot=sw.Snapshots(every=1, folder=str(root)))
    info = sw.checkpoint.resume(root / "ckpt", b)
    assert info is not None and info.step == 2, info
    assert (b.train_steps, b.dropout_seed) == (2, 3), (b.train_steps, b.dropout_seed)
    same(state(b), state(a), "resumed at the merge's end")
    runs = []
    for p in (a, b):
        with p.no_sync():
            losses = train(p, range(3, 4))
        runs.append(losses + train(p, range(4, 5)))
    assert runs[0] == runs[1], runs
    return {"compared": same(state(a), state(b), "after step 4"), "losses": runs[0]}


def clean_exit(ctx: Ctx) -> None:
    """What a clean exit does (the last snapshot finished, this job's snapshots on the machine removed)."""
    root = folder(ctx, "exit")
    a = pipe(snapshot=sw.Snapshots(every=1, folder=str(root)))
    train(a, range(1, 3))
    a.snapshots.release_at_exit()
    dist.barrier()
    left = list(a.snapshots.folder.glob("*.snap")) if a.snapshots.folder.exists() else []
    assert left == [], left


def one_round_lengths(ctx: Ctx) -> dict[str, Any]:
    """A copy's exchange on gloo itself (snapshot_exchange, in pairs 0-1 and 2-3), its lengths agreed: the second
    exchange posted in one round, the third's grown payload sent after a byte into each part posted for the old
    length, the fourth in one round again; every part whole each time."""
    from stagewise.runtime.comm import snapshot_exchange, snapshot_wire

    group = snapshot_wire.snapshot_group(None, 60.0)
    other, agreed = ctx.rank ^ 1, snapshot_exchange.Agreed()
    for k, n in enumerate((16, 16, 24, 24)):  # (16 posted, 24 sent: gloo fails it, unless filled and followed)
        mine = [torch.full((8,), 10 * k + ctx.rank, dtype=torch.uint8), torch.arange(n, dtype=torch.uint8) + ctx.rank]
        done = snapshot_exchange.exchange_parts(mine, other, [other], group, 60.0, agreed=agreed)
        assert done.failed == [], done.failed
        want = [torch.full((8,), 10 * k + other, dtype=torch.uint8), torch.arange(n, dtype=torch.uint8) + other]
        got = done.parts[other]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (k, got)
        assert agreed.sent == {other: [8, n]} and agreed.expected == {other: [8, n]}, agreed
    return {"exchanges": 4}


def checks(world: int) -> dict[str, Check]:
    assert world == 4
    opt: Any = {"optimizer": adamw}
    return {
        "same-layout": same_layout,
        "other-layout": other_layout,
        "machines": machines,
        "one-folder": one_folder,
        "damaged": damaged,
        "disk-newer": disk_newer,
        "fresh": fresh,
        "copy-before-step": copy_before_step,
        "clean-exit": clean_exit,
        "during-merge": during_merge,
        "one-round-lengths": one_round_lengths,
        "refused-no-optimizer": refused(
            lambda ctx: sw.Pipeline(layers(), loss_fn=mdl.lm_loss, snapshot=2), "needs optimizer="
        ),
        "refused-async": refused(
            lambda ctx: sw.Pipeline(layers(), loss_fn=mdl.lm_loss, schedule="pipedream", snapshot=2, **opt),
            "asynchronous schedule 'pipedream' is not supported",
        ),
        "refused-tp": refused(
            lambda ctx: sw.Pipeline(
                layers(), loss_fn=mdl.lm_loss, parallel=sw.ParallelConfig(pp=2, tp=2), snapshot=2, **opt
            ),  # fmt: skip
            "snapshots of split or sharded parameters are not implemented",
        ),
        "refused-hetpipe": refused(
            lambda ctx: sw.HetPipe(layers(), virtual_workers=[[0, 1], [2, 3]], loss_fn=mdl.lm_loss, snapshot=2, **opt),
            "HetPipe does not take snapshot=",
        ),
        "refused-resume-optimizer": lambda ctx: _resume_with_optimizer(ctx),
    }


def _resume_with_optimizer(ctx: Ctx) -> None:
    root = folder(ctx, "resume-optimizer")
    a = pipe(snapshot=sw.Snapshots(every=2, folder=str(root)))
    raises(ValueError, "resumes its own optimizers", lambda: sw.checkpoint.resume(root, a, adamw(list(a.parameters()))))
