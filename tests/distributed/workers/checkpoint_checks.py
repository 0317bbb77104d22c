"""Checkpoint checks: save under one layout, load under another, in separate torchrun jobs (fresh processes).

    STAGEWISE_CKPT_DIR=DIR torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py \
        --checks checkpoint_checks --suite save2 --out OUT

The suites run in order, sharing ``STAGEWISE_CKPT_DIR``: ``save2`` (2 ranks)
saves at pp=2; ``save4`` (4 ranks) loads those at pp=4 and saves at pp=4 and
pp2 x dp2; ``resume2`` and ``resume4`` start fresh processes that load and
continue. A saving run also records, as plain tensors per rank
(``torch.save``), its parameters and optimizer state by name, and the losses
of the steps after the save: the references the loading runs compare with,
bit for bit where the layout is the same. The models are in checkpoint_models.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stagewise as sw
from checkpoint_models import BATCH, PP2_DP2, PP2_SHARDING2, PP2_TP2, adamw, pipeline, plain, tied, train
from helpers import models as mdl
from stagewise.checkpoint import CheckpointError
from stagewise.runtime.checkpoint.state import canonical
from stagewise.runtime.hybrid.tensor_parallel import full
from worker import Check, Ctx, raises

RTOL = 1e-10  # float64, another layout (tp, sharding too): only the summation order differs


def root() -> Path:
    return Path(os.environ["STAGEWISE_CKPT_DIR"])


# ---- references ---------------------------------------------------------------------------------
def optimizer_state(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in module.named_parameters()}
    out = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    out[f"{names[id(p)]}/{key}"] = full(value.detach()).clone()
                out[f"{names[id(p)]}/lr"] = torch.tensor(group["lr"], dtype=torch.float64)
    return out


def dump(tag: str, ctx: Ctx, module: nn.Module, optimizers: list[torch.optim.Optimizer], losses: list[float]) -> None:
    """This rank's parameters and optimizer state by name, and the losses: the reference for a later job."""
    params = {n: full(p.detach()).clone() for n, p in module.named_parameters()}  # DTensors whole
    torch.save({"params": params, "optim": optimizer_state(module, optimizers)}, root() / f"{tag}.rank{ctx.rank}.pt")
    if ctx.rank == 0:
        (root() / f"{tag}.losses.json").write_text(json.dumps(losses))
    gathered_as_dumped(tag, ctx, module)


def gathered_as_dumped(tag: str, ctx: Ctx, module: nn.Module) -> None:
    """``gather_state_dict`` merges on the last rank what every rank dumped (each rank's dump precedes its part
    of the collective): each parameter whole (DTensors gathered) and once (replicas' and shards' names), bit for
    bit."""
    merged = sw.runtime.gather_state_dict(module, dst=ctx.world - 1)
    if ctx.rank != ctx.world - 1:
        assert merged is None, f"rank {ctx.rank} got a state dict; only rank {ctx.world - 1} should"
        return
    assert merged is not None
    params, _, _ = reference(tag)
    params = {canonical(k): v for k, v in params.items()}  # (compiled layers: merged as checkpoints name them)
    assert params.keys() <= merged.keys(), f"not gathered: {sorted(params.keys() - merged.keys())}"
    for name, value in params.items():
        assert merged[name].dtype == value.dtype and torch.equal(merged[name], value), f"{tag}: {name} gathered wrong"


def reference(tag: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    """The union over the saving job's ranks of what :func:`dump` wrote (a name on two ranks must agree)."""
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    for path in sorted(root().glob(f"{tag}.rank*.pt")):
        part = torch.load(path, weights_only=True)
        for into, got in ((params, part["params"]), (optim, part["optim"])):
            for k, v in got.items():
                assert k not in into or torch.equal(into[k], v), f"{tag}: {k} differs between saving ranks"
                into[k] = v
    return params, optim, json.loads((root() / f"{tag}.losses.json").read_text())


def assert_same(module: nn.Module, optimizers: list[torch.optim.Optimizer], tag: str, optim: bool = True) -> int:
    """Every parameter (and optimizer state entry) held here equals the saving run's, bit for bit; how many."""
    params, states, _ = reference(tag)
    n = 0
    for name, p in module.named_parameters():
        assert name in params, f"{name} not in the reference"
        assert torch.equal(full(p.detach()), params[name]), f"parameter {name} differs from the saved run's"
        n += 1
    if optim:
        mine = optimizer_state(module, optimizers)
        assert mine.keys() <= states.keys() and mine, (sorted(mine)[:4], sorted(states)[:4])
        for key, value in mine.items():
            assert torch.equal(value.to(states[key].dtype), states[key]), f"optimizer state {key} differs"
    return n


def close(a: float, b: float) -> None:
    assert abs(a - b) <= RTOL * abs(b), f"loss {a!r} vs {b!r}"


def own(pipe: sw.Pipeline) -> list[torch.optim.Optimizer]:
    return [pipe.optimizers[s] for s in sorted(pipe.optimizers)]


# ---- save2: pp=2 on 2 ranks ----------------------------------------------------------------------
def save_resume(model: str, schedule: str, tag: str, user_optimizer: bool = False, **kw: Any) -> Check:
    """2 steps, save, 2 more steps: the uninterrupted run; its last losses and parameters are the reference."""

    def check(ctx: Ctx) -> dict[str, Any]:
        pipe = pipeline(model, schedule, seed=1, factory=not user_optimizer, **kw)
        opt = sched = None
        if user_optimizer:  # one optimizer over the pipeline's parameters, and an LR schedule
            opt = adamw(list(pipe.parameters()))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        torch.manual_seed(1234 + ctx.rank)
        losses = train(pipe, 0, 2, opt, sched)
        sw.checkpoint.save(root() / tag, pipe, opt, step=2, extra={"next_batch": 2}, scheduler=sched, keep=2)
        losses += train(pipe, 2, 2, opt, sched)
        dump(tag, ctx, pipe, [opt] if opt else own(pipe), losses)
        return {"losses": losses}

    return check


def save_for_reshard(model: str, schedule: str, tag: str, **kw: Any) -> Check:
    """2 steps, save (the reference: parameters and optimizer state at the save), then one more step's loss."""

    def check(ctx: Ctx) -> None:
        pipe = pipeline(model, schedule, seed=1, **kw)
        train(pipe, 0, 2)
        sw.checkpoint.save(root() / tag, pipe, step=2)
        dump(tag, ctx, pipe, own(pipe), [])
        next_loss = train(pipe, 2, 1)
        if ctx.rank == 0:
            (root() / f"{tag}.losses.json").write_text(json.dumps(next_loss))

    return check


def keeps_the_last_two(ctx: Ctx) -> dict[str, Any]:
    """keep=2: after four saves, only steps 2 and 3 remain; latest() is step 3. A newer step-N that lost its
    manifest is refused by load and resume on every rank (never a silent fall-back), naming how to fall back;
    once it is moved away, the newest complete one loads, and an interrupted save (``.step-N.tmp``) is named
    in the reason and ignored."""
    pipe = pipeline("plain", "1f1b", seed=1)
    where = root() / "keep"
    for step in range(4):
        sw.checkpoint.save(where, pipe, step=step, keep=2)
    assert sorted(p.name for p in where.glob("step-*")) == ["step-00000002", "step-00000003"]
    dist.barrier()
    if ctx.rank == 0:  # a later checkpoint whose manifest went away, and a save that died before its manifest
        shutil.copytree(where / "step-00000003", where / "step-00000009")
        (where / "step-00000009" / "MANIFEST.json").unlink()
        shutil.copytree(where / "step-00000003", where / ".step-00000010.tmp")
    dist.barrier()
    assert sw.checkpoint.latest(where) == where / "step-00000003"
    words = ["step-00000009, is incomplete", "refusing to fall back", "move step-00000009 away"]
    refused = raises(CheckpointError, words, lambda: sw.checkpoint.load(where, pipe))
    raises(CheckpointError, words, lambda: sw.checkpoint.resume(where, pipe))
    dist.barrier()
    if ctx.rank == 0:
        (where / "step-00000009").rename(where / "damaged-9")
    dist.barrier()
    info = sw.checkpoint.load(where, pipe)
    assert info.step == 3, info
    assert "the newest of 2 complete checkpoints" in info.reason, info.reason
    assert "interrupted save of step 10 is ignored" in info.reason, info.reason
    resumed = sw.checkpoint.resume(where, pipe)
    assert resumed is not None and resumed.step == 3 and resumed.reason == info.reason, resumed
    return {"refused": refused, "reason": info.reason}


def refuses(ctx: Ctx) -> dict[str, Any]:
    """A flipped byte, a missing manifest, another model: every rank raises, naming the file or the tensor."""
    pipe = pipeline("plain", "1f1b", seed=1)
    train(pipe, 0, 1)
    good = sw.checkpoint.save(root() / "refuse", pipe, step=1)
    flipped, partial = root() / "flipped", root() / "partial"
    if ctx.rank == 0:
        for copy in (flipped, partial):
            shutil.copytree(good, copy)
        data = data_file(flipped)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        (partial / "MANIFEST.json").unlink()
    dist.barrier()
    other = pipeline("plain", "1f1b", seed=5)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    seen = {}
    seen["flipped"] = raises(
        CheckpointError, [str(data_file(flipped)), "corrupted"], lambda: sw.checkpoint.load(flipped, other)
    )
    seen["partial"] = raises(CheckpointError, ["partial", "MANIFEST.json"], lambda: sw.checkpoint.load(partial, other))
    smaller = sw.Pipeline(mdl.lm(3), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=4, timeout=60)
    seen["fewer"] = raises(
        CheckpointError, ["'4.qkv.weight'", "not in the model"], lambda: sw.checkpoint.load(good, smaller)
    )
    bigger = sw.Pipeline(mdl.lm(5), loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=4, timeout=60)
    seen["more"] = raises(
        CheckpointError, ["'5.qkv.weight'", "missing from the checkpoint"], lambda: sw.checkpoint.load(good, bigger)
    )
    wider = sw.Pipeline(
        [sw.Layer(nn.Embedding, mdl.VOCAB + 1, mdl.D, dtype=torch.float64)] + mdl.lm(4)[1:],
        loss_fn=mdl.lm_loss,
        schedule="1f1b",
        microbatches=4,
        timeout=60,
    )
    seen["shape"] = raises(
        CheckpointError, ["'0.weight'", "shape (32, 16)", "(33, 16)"], lambda: sw.checkpoint.load(good, wider)
    )
    for name, p in other.named_parameters():  # the refused loads touched nothing
        assert torch.equal(p.detach(), before[name]), name
    return seen


def refuses_divergent_replicas(ctx: Ctx) -> dict[str, Any]:
    """pp2 x dp2: one replica's weight nudged by one ulp; the save is refused on every rank, naming it and the
    ranks, and nothing is published. A replicated optimizer state diverging is named too."""
    pipe = pipeline("plain", "1f1b", seed=1, **PP2_DP2)
    train(pipe, 0, 1)
    name, param = next(iter(pipe.named_parameters()))
    names = [None] * ctx.world
    dist.all_gather_object(names, name)
    if ctx.rank == ctx.world - 1:
        with torch.no_grad():
            param.view(-1)[0] = torch.nextafter(param.view(-1)[0], torch.tensor(math.inf, dtype=param.dtype))
    twins = [r for r, n in enumerate(names) if n == names[-1]]
    assert len(twins) == 2, names
    err = raises(
        CheckpointError,
        [f"{names[-1]!r}", f"rank {twins[0]} vs rank {twins[1]}", "diverged"],
        lambda: sw.checkpoint.save(root() / "diverged", pipe, step=1),
    )
    assert not list((root() / "diverged").glob("step-*")), "a divergent checkpoint was published"
    return {"error": err}


def data_file(folder: Path) -> Path:
    return sorted(folder.rglob("*.distcp"))[-1]


def load_seed(ctx: Ctx) -> None:
    """A one-process model's checkpoint (the "seed checkpoint", saved by the test) loads into a pipeline."""
    pipe = pipeline("plain", "1f1b", seed=9)
    info = sw.checkpoint.load(root() / "seed", pipe)
    assert not info.optimizer_restored and not info.rng_restored, info
    reference = sw.build_model(plain(), seed=42)
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.equal(p.detach(), ref[name].detach()), name


class Tagged(nn.Module):
    """An unmodified model cut by stage tags (``Pipeline.from_model``); a residual crosses the cut."""

    def __init__(self) -> None:
        super().__init__()
        with sw.stage(0):
            self.embed = nn.Linear(mdl.D, 32, dtype=torch.float64)
        with sw.stage(1):
            self.body = nn.Sequential(nn.Tanh(), nn.Linear(32, 32, dtype=torch.float64))
            self.head = nn.Linear(32, mdl.CLASSES, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.body(h) + h)


def from_model(ctx: Ctx) -> dict[str, Any]:
    """A ``from_model`` pipeline saves under the model's own names: it loads into the plain model, and back."""
    torch.manual_seed(0)
    pipe = sw.Pipeline.from_model(Tagged(), loss_fn=nn.functional.cross_entropy, microbatches=4, optimizer=adamw)
    x, y = mdl.mlp_data(8, seed=3)
    pipe.train_step(x, y)
    sw.checkpoint.save(root() / "tagged", pipe, step=1)
    torch.manual_seed(1)
    model = Tagged()
    opt = adamw(list(model.parameters()))
    sw.checkpoint.load(root() / "tagged", model, opt)
    mine = dict(model.named_parameters())
    for name, p in pipe.named_parameters():
        assert torch.equal(p.detach(), mine[name].detach()), name
        assert torch.equal(pipe.optimizers[pipe.local_stages[0]].state[p]["exp_avg"], opt.state[mine[name]]["exp_avg"])
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(x), y))
    loss = pipe.train_step(x, y)
    close(loss, expected)
    torch.manual_seed(2)
    again = sw.Pipeline.from_model(Tagged(), loss_fn=nn.functional.cross_entropy, microbatches=4, optimizer=adamw)
    sw.checkpoint.load(root() / "tagged", again)
    close(again.train_step(x, y), expected)
    return {"loss": loss}


class FoundTie(nn.Module):
    """A built LM whose head is its embedding (``head.weight = embed.weight``, found by ``from_model``): under 1F1B
    rank 1 holds it as ``head.weight`` alone, under ZB-V rank 0 holds both names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(mdl.VOCAB, mdl.D, dtype=torch.float64)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(mdl.D, mdl.D, dtype=torch.float64), nn.Tanh()) for _ in range(4))
        )
        self.head = nn.Linear(mdl.D, mdl.VOCAB, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def found_tie(schedule: str, seed: int) -> sw.Pipeline:
    torch.manual_seed(seed)
    return sw.Pipeline.from_model(FoundTie(), loss_fn=mdl.lm_loss, schedule=schedule, microbatches=4, optimizer=adamw)


def save_found_tie(ctx: Ctx) -> dict[str, Any]:
    """The tied weight's optimizer state is saved under its one-process name (``embed.weight``) from every rank
    holding it, so the checkpoint loads into one process and into a layout that holds both names on one rank."""
    pipe = found_tie("1f1b", seed=1)
    named = [n for n, p in pipe.named_parameters() if p.shape == (mdl.VOCAB, mdl.D)]
    assert named == ["embed.weight"], f"rank {ctx.rank} lists the tied weight as {named}"
    train(pipe, 0, 2)
    sw.checkpoint.save(root() / "ftie", pipe, step=2)
    dump("ftie", ctx, pipe, own(pipe), [])
    next_loss = train(pipe, 2, 1)
    if ctx.rank == 0:
        (root() / "ftie.losses.json").write_text(json.dumps(next_loss))
    return {"named": named}


def load_found_tie(ctx: Ctx) -> dict[str, Any]:
    """The 1F1B checkpoint into ZB-V (the embedding and the head on rank 0): state and next loss as saved."""
    pipe = found_tie("zb-v", seed=7)
    info = sw.checkpoint.load(root() / "ftie", pipe)
    assert info.optimizer_restored
    n = assert_same(pipe, own(pipe), "ftie")
    loss = train(pipe, 2, 1)[0]
    close(loss, reference("ftie")[2][0])
    return {"parameters": n, "loss": loss}


# ---- loading elsewhere ---------------------------------------------------------------------------
def load_reshard(model: str, schedule: str, tag: str, **kw: Any) -> Check:
    """Load a checkpoint saved under another layout: parameters and optimizer state exact, next loss close."""

    def check(ctx: Ctx) -> dict[str, Any]:
        pipe = pipeline(model, schedule, seed=77, **kw)
        info = sw.checkpoint.load(root() / tag, pipe)
        assert info.step == 2 and info.optimizer_restored, info
        n = assert_same(pipe, own(pipe), tag)
        _, _, next_loss = reference(tag)
        loss = train(pipe, 2, 1)[0]
        close(loss, next_loss[0])
        return {"parameters": n, "loss": loss, "saved_layout": info.layout}

    return check


def resume(model: str, schedule: str, tag: str, user_optimizer: bool = False, **kw: Any) -> Check:
    """Fresh processes, a fresh pipeline (another seed) and RNG: load, 2 steps: bit-exact with the uninterrupted."""

    def check(ctx: Ctx) -> dict[str, Any]:
        pipe = pipeline(model, schedule, seed=99, factory=not user_optimizer, **kw)
        opt = sched = None
        if user_optimizer:
            opt = adamw(list(pipe.parameters()))
            opt.param_groups[0]["lr"] = 123.0  # the checkpoint's hyper-parameters come back
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        torch.manual_seed(999)  # another RNG state: the checkpoint's must come back
        info = sw.checkpoint.load(root() / tag, pipe, opt, scheduler=sched)
        assert info.step == 2 and info.extra == {"next_batch": 2} and info.rng_restored, info
        assert info.scheduler_restored == user_optimizer, info
        losses = train(pipe, info.extra["next_batch"], 2, opt, sched)
        _, _, saved = reference(tag)
        assert losses == saved[2:], f"resumed losses {losses!r} != uninterrupted {saved[2:]!r}"
        assert_same(pipe, [opt] if opt else own(pipe), tag)
        return {"losses": losses}

    return check


def tied_restore(ctx: Ctx) -> dict[str, Any]:
    """The tied copy on the rank holding only the head is loaded too: equal to the one-process model loaded alike."""
    pipe = pipeline("tied", "1f1b", seed=31)
    assert pipe.tied_copies if ctx.rank == 1 else True  # the case of the issue: rank 1 holds a copy
    sw.checkpoint.load(root() / "tied", pipe)
    assert_same(pipe, own(pipe), "tied")
    model = sw.build_model(tied(), seed=32)
    sw.checkpoint.load(root() / "tied", model)
    x, y = mdl.lm_data(BATCH, seed=500)
    with torch.no_grad():
        ref = float(mdl.lm_loss(model(x), y))
    out = pipe.eval_step(x)
    loss = float(mdl.lm_loss(out, y)) if out is not None else None
    everyone: list[Any] = [None] * ctx.world
    dist.all_gather_object(everyone, loss)
    got = [v for v in everyone if v is not None][0]
    close(got, ref)
    return {"pipeline": got, "one_process": ref}


# ---- suites -----------------------------------------------------------------------------------------
def suites(world: int) -> dict[str, dict[str, Check]]:
    return {
        "save2": {
            "save-1f1b-dropout": save_resume("dropout", "1f1b", "r-1f1b"),
            "save-zbv-dropout-user-optimizer": save_resume("dropout", "zb-v", "r-zbv", user_optimizer=True),
            "save-pp2-1f1b": save_for_reshard("plain", "1f1b", "p2"),
            "save-compiled-zbv": save_for_reshard("compiled", "zb-v", "comp"),
            "save-tied-pp2": save_for_reshard("tied", "1f1b", "tied"),
            "save-tied-wrapped-pp2": save_for_reshard("tied-wrapped", "1f1b", "tiedw"),
            "load-seed-checkpoint-pp2": load_seed,
            "keep-and-latest": keeps_the_last_two,
            "from-model-pipeline": from_model,
            "save-found-tie-1f1b": save_found_tie,
            "refuses-bad-checkpoints": refuses,
        },
        "save4": {
            "load-pp2-into-pp4": load_reshard("plain", "1f1b", "p2"),
            "save-pp4-1f1b": save_for_reshard("plain", "1f1b", "p4"),
            "save-pp2xdp2": save_resume("dropout", "1f1b", "r-h", **PP2_DP2),
            "save-pp2xtp2": save_for_reshard("tp", "1f1b", "tp", **PP2_TP2),
            "save-pp2xsharding2": save_for_reshard("tp", "1f1b", "sh", **PP2_SHARDING2),
            "refuses-divergent-replicas": refuses_divergent_replicas,
        },
        "resume2": {
            "resume-1f1b": resume("dropout", "1f1b", "r-1f1b"),
            "resume-zbv-user-optimizer": resume("dropout", "zb-v", "r-zbv", user_optimizer=True),
            "load-pp2-1f1b-into-zbv": load_reshard("plain", "zb-v", "p2"),
            "load-compiled-into-compiled-1f1b": load_reshard("compiled", "1f1b", "comp"),
            "load-pp4-1f1b-into-pp2-zbv": load_reshard("plain", "zb-v", "p4"),
            "load-pp4-1f1b-into-pp2-interleaved": load_reshard("plain", "interleaved-1f1b", "p4"),
            "tied-restore-pp2": tied_restore,
            "load-found-tie-1f1b-into-zbv": load_found_tie,
            "load-pp2xtp2-into-pp2": load_reshard("tp", "1f1b", "tp"),
        },
        "resume4": {
            "resume-pp2xdp2": resume("dropout", "1f1b", "r-h", **PP2_DP2),
            "load-pp2xtp2-into-pp2xsharding2": load_reshard("tp", "1f1b", "tp", **PP2_SHARDING2),
            "load-pp2xsharding2-into-pp2xtp2": load_reshard("tp", "zb-h1", "sh", **PP2_TP2),
            "load-pp2xsharding2-into-pp4": load_reshard("tp", "1f1b", "sh"),
        },
    }


def checks(world: int, suite: str | None = None) -> dict[str, Check]:
    """``suite``'s checks; None (a shared job of ``world`` ranks: tests/distributed/test_checkpoint.py) the saves."""
    return suites(world)[suite or f"save{world}"]
