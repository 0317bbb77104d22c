"""Reproducible dropout (issue 42) on 4 gloo ranks (and a gradient merge of it on 2), run by feature_checks.py.

A layer list whose blocks drop (``nn.Dropout(0.3)``, and a block calling ``F.dropout`` with its own
``dropout`` attribute) is trained two steps under several layouts and schedules - pp 4 and pp 2, 1F1B,
ZB-V, interleaved, with and without recompute, pp 2 x dp 2 - and each is compared in float64 with the
one-process model looping over the micro-batches with the same seeding, stated independently here
(:func:`oracle_key`, not the library's). A checkpoint taken after a step resumes the masks.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_grads_close
from worker import Check, Ctx, gather_objects

D, CLASSES, M, SEED, DROPOUT_SEED = 8, 3, 4, 5, 7
TIMEOUT = 60.0


class Block(nn.Module):
    """A residual block with a dropout layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.drop = nn.Dropout(0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.lin(self.drop(h))))  # (called twice: two masks)


class Functional(nn.Module):
    """A block calling the functional dropout with its own rate (as transformers' attentions do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.attention_dropout = 0.2

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.dropout(torch.tanh(self.lin(h)), p=self.attention_dropout, training=self.training)


def layers() -> list[Any]:
    blocks = [sw.Layer(Functional if k % 3 == 1 else Block) for k in range(8)]
    return [*blocks, sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64)]


def data(step: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(rows, D, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (rows,), generator=g)


# ---- the one-process reference, its seeding stated again --------------------------------------------------
def _mix(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def oracle_key(replica: int, step: int, microbatch: int, name: str, call: int) -> int:
    """The documented key: (seed, replica, step, micro-batch, BLAKE2b-64 of the name, call) folded by splitmix64."""
    code = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    h = 0
    for word in (DROPOUT_SEED, replica, step, microbatch, code, call):
        h = _mix(h ^ word)
    return h >> 1


@contextmanager
def seeded(model: nn.Module, replica: int, step: int, microbatch: int) -> Iterator[None]:
    """Each module that drops runs with the CPU generator seeded by :func:`oracle_key`, restored after."""
    names = {id(m): n for n, m in model.named_modules() if isinstance(m, (nn.Dropout, Functional))}
    calls: dict[int, int] = {}
    handles = []
    for module in model.modules():
        if id(module) not in names:
            continue

        def before(mod: nn.Module, args: Any) -> None:
            k = calls.get(id(mod), 0)
            calls[id(mod)] = k + 1
            mod.__dict__["_saved"] = torch.get_rng_state()
            torch.manual_seed(oracle_key(replica, step, microbatch, names[id(mod)], k))

        def after(mod: nn.Module, args: Any, out: Any) -> None:
            torch.set_rng_state(mod.__dict__.pop("_saved"))

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference(steps: int, replicas: int = 1) -> tuple[nn.Module, list[float]]:
    """The one-process model after ``steps`` train steps' gradients (accumulated), and each step's loss: every
    replica's share, every micro-batch, each under its seeding, weighted by its share of the global batch."""
    model = sw.build_model(layers(), seed=SEED)
    losses = []
    for step in range(steps):
        x, y = data(step)
        total = 0.0
        for r, (xr, yr) in enumerate(zip(x.tensor_split(replicas), y.tensor_split(replicas))):
            for i, (xi, yi) in enumerate(zip(xr.tensor_split(M), yr.tensor_split(M))):
                with seeded(model, r, step, i):
                    part = F.cross_entropy(model(xi), yi) * (len(yi) / len(y))
                part.backward()
                total += float(part.detach())
        losses.append(total)
    return model, losses


# ---- checks ---------------------------------------------------------------------------------------------
def pipeline(group: Any, **options: Any) -> sw.Pipeline:
    return sw.Pipeline(
        layers(), loss_fn=F.cross_entropy, microbatches=M, seed=SEED, dropout_seed=DROPOUT_SEED, timeout=TIMEOUT,
        **({"group": group} if group is not None else {}), **options,
    )  # fmt: skip


def train(pipe: sw.Pipeline, steps: int) -> list[float]:
    return [pipe.train_step(*pipe.local_batch(*data(step))) for step in range(steps)]


def pair_group(ctx: Ctx) -> Any:
    """This rank's pair (ranks 0-1 or 2-3), for a pipeline of 2 ranks (every rank makes both groups, in order)."""
    made = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return made[ctx.rank // 2]


def layouts(ctx: Ctx) -> dict[str, Any]:
    """pp 4 (1F1B, ZB-V, interleaved with recompute every layer) and pp 2 (1F1B with recompute of whole stages):
    every loss equal to the one-process reference's and to each other's, every gradient the reference's; the
    masks matter (the plain model's losses are others)."""
    ref, want = reference(2)
    pair = pair_group(ctx)
    runs = {
        "pp4 1f1b": pipeline(None, schedule="1f1b"),
        "pp4 zb-v": pipeline(None, schedule="zb-v"),
        "pp4 interleaved recompute=1": pipeline(None, schedule="interleaved-1f1b", virtual_stages=2, recompute=1),
        "pp2 1f1b recompute=stage": pipeline(pair, schedule="1f1b", recompute="stage"),
    }
    got = {}
    for what, pipe in runs.items():
        got[what] = train(pipe, 2)
        for a, b in zip(got[what], want):
            assert abs(a - b) <= 1e-12, (what, got[what], want)
        assert_grads_close(pipe, ref, what)
    plain = sw.build_model(layers(), seed=SEED).eval()
    gap = max(abs(float(F.cross_entropy(plain(data(s)[0]), data(s)[1])) - want[s]) for s in range(2))
    assert gap > 1e-3, f"the masks change nothing: the check would not see them wrong ({gap})"
    return {"losses": want, "gap to no dropout": gap}


def data_parallel(ctx: Ctx) -> dict[str, Any]:
    """pp 2 x dp 2: each replica draws its own masks (the replica is in the key), as the reference does looping
    over the replicas' shares."""
    ref, want = reference(2, replicas=2)
    pipe = pipeline(None, schedule="1f1b", parallel=sw.ParallelConfig(pp=2, dp=2))
    got = train(pipe, 2)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-12, (got, want)
    assert_grads_close(pipe, ref, "pp2 x dp2")
    return {"losses": got}


def resumed(ctx: Ctx) -> dict[str, Any]:
    """A checkpoint keeps the step count: a pipeline loading it after one step draws the second step's masks."""
    folder = Path(gather_objects(tempfile.mkdtemp() if ctx.rank == 0 else None, None)[0])
    try:
        first = pipeline(None, schedule="1f1b")
        first.train_step(*data(0))
        sw.checkpoint.save(folder, first, step=1)
        again = pipeline(None, schedule="1f1b")
        sw.checkpoint.load(folder, again)
        assert again.train_steps == 1, again.train_steps
        a, b = first.train_step(*data(1)), again.train_step(*data(1))
        assert a == b, (a, b)
        return {"loss": a}
    finally:
        gather_objects(None, None)
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def merged(ctx: Ctx) -> dict[str, Any]:
    """pp 2 (the training guide's block): ZB-V with recompute of whole stages, a gradient merge of two steps (the
    first under ``no_sync()``), then ``clip_grad_norm_``: the losses, the norm and every clipped gradient are the
    one-process reference's (its two steps' gradients accumulated, then clipped)."""
    ref, want = reference(2)
    pipe = pipeline(ctx.group, schedule="zb-v", recompute="stage")
    with pipe.no_sync():
        got = [pipe.train_step(*data(0))]
    got.append(pipe.train_step(*data(1)))
    assert all(abs(a - b) <= 1e-12 for a, b in zip(got, want, strict=True)), (got, want)
    norm = float(pipe.clip_grad_norm_(1.0))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    assert abs(norm - ref_norm) <= 1e-10 * ref_norm and ref_norm > 1.0, (norm, ref_norm)  # (> 1: the clip acts)
    assert_grads_close(pipe, ref, "merged, clipped")
    return {"losses": got, "norm": norm}


def checks(world: int) -> dict[str, Check]:
    if world == 2:
        return {"dropout-merge-zb-v": merged}
    assert world == 4, "the dropout checks run on 2 or 4 ranks"
    return {"dropout-layouts": layouts, "dropout-dp": data_parallel, "dropout-resumed": resumed}
