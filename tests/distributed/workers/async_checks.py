"""Asynchronous pipelines on every rank of one torchrun job, against the one-process reference.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks async_checks --out DIR

Each parity check trains a float64 MLP on a stream of mini-batches with
``Pipeline.train_stream`` (windows of N mini-batches, a shorter last one) and
compares every loss and every local parameter with ``async_reference``
replaying the same schedule's rule, to 1e-12. The mutant checks run the
pipeline with one rule and the reference with another and require a
difference far above that tolerance, so the parity checks can fail. The refusal
checks expect a ValueError naming the constraint, raised alike on every rank
before anything is exchanged. ``checks(world)`` is a pure function of the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl
from oracles.async_reference import async_reference
from stagewise.asynchronous import live_versions, version_bound
from worker import Check, Ctx, refused

TOL = 1e-12

__all__ = ["checks"]

#: (label, name, options, micro-batches per mini-batch as a function of p, optimizer)
VARIANTS: list[tuple[str, str, dict[str, bool], Callable[[int], int], str]] = [
    ("pipedream", "pipedream", {}, lambda p: 1, "sgd"),
    ("pipedream-m2", "pipedream", {}, lambda p: 2, "adam"),
    ("pipedream-nostash", "pipedream", {"stashing": False}, lambda p: 1, "sgd"),
    ("pipedream-vsync", "pipedream", {"vertical_sync": True}, lambda p: 1, "adam"),
    ("2bw", "pipedream-2bw", {}, lambda p: max(1, p - 1), "sgd"),
    ("xpipe-momentum", "xpipe", {}, lambda p: 1, "momentum"),
    ("xpipe-adamw", "xpipe", {}, lambda p: 2, "adamw"),
]


def cut(pipe: sw.Pipeline) -> list[int]:
    """The pipeline's layers per stage (its default partition chose them), for the replay to cut alike."""
    return [len(r) for r in pipe.layer_ranges]


def optimizer(kind: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.05)
        if kind == "momentum":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
        if kind == "adam":
            return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        raise ValueError(kind)

    return make


def stream(count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [mdl.mlp_data(batch, seed=100 + k) for k in range(count)]


def run_pipeline(
    ctx: Ctx, schedule: sw.Schedule, opt: str, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], sw.Pipeline]:
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule=schedule, optimizer=optimizer(opt), seed=3)
    first, last = ctx.rank == 0, ctx.rank == ctx.world - 1
    mine = [(x if first else None, y if last else None) for x, y in data]
    losses = list(pipe.train_stream(iter(mine)))
    return losses, pipe


def compare(pipe: sw.Pipeline, losses: list[float], ref: Any) -> float:
    """The largest difference between the pipeline's losses and parameters and the reference's."""
    assert len(losses) == len(ref.losses), (len(losses), len(ref.losses))
    worst = max(abs(a - b) for a, b in zip(losses, ref.losses))
    params = dict(ref.model.named_parameters())
    for name, p in pipe.named_parameters():
        worst = max(worst, (p.detach() - params[name].detach()).abs().max().item())
    return worst


def parity(name: str, options: dict[str, bool], m_of: Callable[[int], int], opt: str, window: int) -> Check:
    def check(ctx: Ctx) -> dict[str, Any]:
        p, m = ctx.world, m_of(ctx.world)
        schedule = sw.schedules.async_schedule(name, p, window, m, **options)
        data = stream(2 * window + 1, 4 * m)  # two full windows and a shorter one
        losses, pipe = run_pipeline(ctx, schedule, opt, data)
        ref = async_reference(
            mdl.mlp(), schedule, optimizer(opt), data, loss_fn=F.cross_entropy, seed=3, counts=cut(pipe)
        )
        worst = compare(pipe, losses, ref)
        assert worst <= TOL, f"{name} {options}: differs from the reference by {worst:.3e}"
        moved = max(abs(a - b) for a, b in zip(losses, ref.losses[:1] * len(losses)))
        assert moved > 1e-3, "the losses did not change: the check would not see a wrong update"
        table = schedule.meta["versions"]
        counted = live_versions(schedule.ranks, table)  # the simulator's count, the current weights included
        held = {s: row["peak_snapshots"] for s, row in pipe.version_report().items()}
        for s, peak in held.items():
            bound = version_bound(table.policy, p, m, s)
            assert 1 <= peak <= max(counted[s]) <= bound, (s, peak, max(counted[s]), bound)
        return {"worst": worst, "snapshots": held}

    return check


def mutant(name: str, options: dict[str, bool], claimed: dict[str, bool], m: int, opt: str) -> Check:
    """Run ``options`` in the pipeline, replay ``claimed`` in the reference: parity must fail by far."""

    def check(ctx: Ctx) -> dict[str, Any]:
        p = ctx.world
        data = stream(2 * p + 2, 4 * m)
        losses, pipe = run_pipeline(ctx, sw.schedules.async_schedule(name, p, 2 * p + 2, m, **options), opt, data)
        wrong = sw.schedules.async_schedule(name, p, 2 * p + 2, m, **claimed)
        ref = async_reference(mdl.mlp(), wrong, optimizer(opt), data, loss_fn=F.cross_entropy, seed=3, counts=cut(pipe))
        worst = compare(pipe, losses, ref)
        assert worst > 1e4 * TOL, f"running {options} and replaying {claimed} agree to {worst:.3e}"
        return {"worst": worst}

    return check


def _pipe(**kw: Any) -> Callable[[Ctx], Any]:
    def build(ctx: Ctx) -> Any:
        options = {"loss_fn": F.cross_entropy, "schedule": sw.schedules.async_schedule("pipedream", ctx.world, 2)}
        options.update(kw)
        return sw.Pipeline(kw.pop("layers", mdl.mlp()), **options)

    return build


def _train_step_refused(ctx: Ctx) -> Any:
    pipe = sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule=sw.schedules.async_schedule("xpipe", ctx.world, 2),
        optimizer=optimizer("adam"),
    )  # fmt: skip
    x, y = mdl.mlp_data(4, 0)
    return pipe.train_step(x, y)


def stream_sync(ctx: Ctx) -> None:
    """train_stream takes a synchronous schedule too: step after step, loss for loss and weight for weight as
    train_step (the optimizer steps through the schedule's STEP actions)."""
    first, last = ctx.rank == 0, ctx.rank == ctx.world - 1
    mine = [(x if first else None, y if last else None) for x, y in stream(3, 4)]
    streamed, stepped = (
        sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, schedule="1f1b", optimizer=optimizer("sgd"), seed=3)
        for _ in range(2)
    )
    assert list(streamed.train_stream(iter(mine))) == [stepped.train_step(x, y) for x, y in mine]
    for (name, a), (_, b) in zip(streamed.named_parameters(), stepped.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _tied(ctx: Ctx) -> Any:
    layers = [
        sw.Tied("emb", sw.Layer(nn.Embedding, 10, mdl.D, dtype=torch.float64)),
        sw.Layer(nn.Linear, mdl.D, mdl.D, dtype=torch.float64),
        sw.Layer(nn.Linear, mdl.D, mdl.D, dtype=torch.float64),
        sw.Tied("emb", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]
    return sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule=sw.schedules.async_schedule("pipedream", ctx.world, 2),
        optimizer=optimizer("sgd"),
    )  # fmt: skip


class _FoundTie(nn.Module):
    """A head tied to the embedding by assignment: a tie ``from_model`` finds, across the two ends' stages."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, mdl.D, dtype=torch.float64)
        self.mids = [f"mid{k}" for k in range(blocks - 2)]
        for name in self.mids:
            setattr(self, name, nn.Linear(mdl.D, mdl.D, dtype=torch.float64))
        self.head = nn.Linear(mdl.D, 10, bias=False, dtype=torch.float64)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for name in self.mids:
            h = torch.tanh(getattr(self, name)(h))
        return self.head(h)


def _found_tie(ctx: Ctx) -> Any:
    """Its copies stepped at each stage's own times drifted 0.28 apart, silently (a user pass)."""
    return sw.Pipeline.from_model(
        _FoundTie(max(3, ctx.world)), loss_fn=F.cross_entropy,
        schedule=sw.schedules.async_schedule("pipedream", ctx.world, 2),
        optimizer=optimizer("sgd"),
    )  # fmt: skip


def _sharded(ctx: Ctx) -> Any:
    return sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule="pipedream", optimizer=optimizer("sgd"),
        parallel=sw.ParallelConfig(pp=ctx.world // 2, sharding=2),
    )  # fmt: skip


def data_parallel(name: str, opt: str, m: int) -> Check:
    """pp = world/2 x dp = 2: replicas stream halves of each mini-batch; equal to the reference on whole ones."""

    def check(ctx: Ctx) -> dict[str, Any]:
        pp, window = ctx.world // 2, ctx.world // 2 + 1
        schedule = sw.schedules.async_schedule(name, pp, window, m)
        pipe = sw.Pipeline(
            mdl.mlp(), loss_fn=F.cross_entropy, schedule=schedule, optimizer=optimizer(opt), seed=3,
            parallel=sw.ParallelConfig(pp=pp, dp=2),
        )  # fmt: skip
        data = stream(2 * window + 1, 4 * m)
        losses = list(pipe.train_stream(pipe.local_batch(x, y) for x, y in data))
        ref = async_reference(
            mdl.mlp(), schedule, optimizer(opt), data, loss_fn=F.cross_entropy, seed=3, counts=cut(pipe)
        )
        worst = compare(pipe, losses, ref)
        assert worst <= TOL, f"{name} with dp=2: differs from the reference by {worst:.3e}"
        return {"worst": worst}

    return check


def eval_after_stream(ctx: Ctx) -> None:
    """eval_step on an asynchronous pipeline runs the live (latest) weights: the reference model's outputs."""
    p = ctx.world
    schedule = sw.schedules.async_schedule("pipedream", p, p + 1)
    data = stream(p + 3, 4)
    losses, pipe = run_pipeline(ctx, schedule, "sgd", data)
    ref = async_reference(
        mdl.mlp(), schedule, optimizer("sgd"), data, loss_fn=F.cross_entropy, seed=3, counts=cut(pipe)
    )
    assert compare(pipe, losses, ref) <= TOL
    x, _ = mdl.mlp_data(2 * (p + 1), seed=7)
    out = pipe.eval_step(x if ctx.rank == 0 else None)
    if ctx.rank == p - 1:
        torch.testing.assert_close(out, ref.model(x).detach(), rtol=0, atol=TOL)


def bad_data_fails_everywhere(ctx: Ctx) -> None:
    """A mini-batch too small for its micro-batches fails on the rank that cuts it and, via the error board, on
    every other rank, instead of leaving them waiting."""
    pipe = sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule=sw.schedules.async_schedule("pipedream", ctx.world, 2, 2),
        optimizer=optimizer("sgd"), timeout=60.0,
    )  # fmt: skip
    data = [mdl.mlp_data(4, 0), mdl.mlp_data(1, 1)]  # the second mini-batch holds 1 sample for 2 micro-batches
    try:
        list(pipe.train_stream(data))
    except (ValueError, sw.PipelineError) as err:
        assert "2 micro-batches need at least 2 samples" in str(err), str(err)
        return
    raise AssertionError("no error")


def checks(world: int) -> dict[str, Check]:
    out: dict[str, Check] = {}
    for label, name, options, m_of, opt in VARIANTS:
        out[f"parity-{label}"] = parity(name, options, m_of, opt, window=world + 1)
    out["mutant-stash-off"] = mutant("pipedream", {"stashing": False}, {}, 1, "sgd")
    out["mutant-vsync-off"] = mutant("pipedream", {}, {"vertical_sync": True}, 1, "sgd")
    out["refuse-no-optimizer"] = refused(_pipe(), "needs optimizer=..., a factory params -> Optimizer")
    out["refuse-recompute"] = refused(_pipe(optimizer=optimizer("sgd"), recompute="stage"), "recompute=")
    out["refuse-xpipe-optimizer"] = refused(
        _pipe(
            schedule=sw.schedules.async_schedule("xpipe", world, 2),
            optimizer=lambda ps: torch.optim.RMSprop(ps),
        ),
        "no weight-prediction rule for the optimizer RMSprop",
    )
    out["refuse-train-step"] = refused(_train_step_refused, "train with train_stream(batches), not train_step")
    out["stream-sync"] = stream_sync
    out["refuse-tied"] = refused(_tied, "tied modules (emb) are not supported")
    out["refuse-found-tie"] = refused(_found_tie, "tied modules (emb.weight) are not supported")
    out["refuse-split-backward"] = refused(
        _pipe(
            optimizer=optimizer("sgd"),
            schedule=sw.passes.split_backward(sw.schedules.async_schedule("pipedream", world, 2)),
        ),
        "asynchronous schedules run whole backwards (B), not I/W",
    )
    out["eval-after-stream"] = eval_after_stream
    if world % 2 == 0 and world >= 4:
        out["refuse-sharding"] = refused(_sharded, "parallel= supports pp and dp only")
        out["dp-pipedream"] = data_parallel("pipedream", "adam", 1)
        out["dp-xpipe"] = data_parallel("xpipe", "momentum", 2)
    out["bad-data-fails-everywhere"] = bad_data_fails_everywhere  # last: it leaves a failed pipeline behind
    return out
