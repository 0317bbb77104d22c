"""The day-two guide's path (docs/guides/day-two.md) as a check on 2 gloo ranks, run in hf_checks.py's job."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import stagewise as sw
from helpers.hf_families import V, build, padded_batch
from worker import Ctx, gather_objects

TIMEOUT = 90.0


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss written out: position t predicts labels[t + 1]; mean over non-ignored tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)


def _owned() -> dict[str, Any]:
    """The day-two guide's own optimizers: AdamW, a warm-up over two steps, clipping at 1."""
    return {
        "optimizer": lambda params: torch.optim.AdamW(params, lr=1e-2),
        "lr_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 2)),
        "clip": 1.0,
    }


def _close(got: float, want: float, what: str) -> None:
    assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (what, got, want)


def day_two(ctx: Ctx) -> dict[str, Any]:
    """The day-two guide's path at 2 ranks: profile and plan a Llama, train the top plan with the pipeline's own
    AdamW, warm-up and clipping (each loss the one-process model's, stepped alike), eval_loss (the one-process eval
    loss), save, resume on the other layout (the same loss, the scheduler where the reference's is), and load into a
    plain transformers model in one process (the same loss again)."""
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    top = sw.plan(sw.profile(model, padded_batch(2, seed=0)[0]), ctx.world, global_batch=8, intra=(1e-5, 1e9))[0]
    pipe = sw.Pipeline.from_plan(top, model, timeout=TIMEOUT, **_owned())
    opt = _owned()["optimizer"](list(ref.parameters()))
    sched = _owned()["lr_scheduler"](opt)
    for step in range(3):
        (ids, mask), labels = padded_batch(8, seed=10 + step)
        loss = pipe.train_step(*pipe.local_batch((ids, mask), labels))
        want = reference_loss(ref(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        _close(loss, want.item(), f"{top.describe()} step {step}")
    (ids, mask), labels = padded_batch(8, seed=20)
    ref.eval()
    with torch.no_grad():
        held_out = reference_loss(ref(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels).item()
    pipe.eval()
    _close(pipe.eval_loss(*pipe.local_batch((ids, mask), labels)), held_out, "eval_loss")
    folder = Path(gather_objects(tempfile.mkdtemp() if ctx.rank == 0 else None, None)[0])
    try:
        sw.checkpoint.save(folder, pipe, step=3)
        layout = sw.ParallelConfig(pp=2) if top.layout.pp == 1 else sw.ParallelConfig(pp=1, dp=2)
        other = sw.Pipeline.from_hf(
            build("llama", 4, seed=1), parallel=layout, schedule="1f1b", microbatches=2, timeout=TIMEOUT, **_owned()
        )
        info = sw.checkpoint.resume(folder, other)
        assert info is not None and info.step == 3 and info.scheduler_restored, info
        lrs = [s.get_last_lr() for s in other.schedulers.values()]  # (this rank's stages')
        assert lrs and all(lr == sched.get_last_lr() for lr in lrs), (lrs, sched.get_last_lr())
        other.eval()
        _close(other.eval_loss(*other.local_batch((ids, mask), labels)), held_out, f"resumed on {layout.describe()}")
        plain = build("llama", 4, seed=2).eval()
        sw.checkpoint.load(folder, plain, collective=False)
        with torch.no_grad():
            direct = reference_loss(plain(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
        _close(direct.item(), held_out, "transformers after load")
        return {"plan": top.describe(), "resumed on": layout.describe()}
    finally:
        gather_objects(None, None)  # every rank is done with the folder
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
