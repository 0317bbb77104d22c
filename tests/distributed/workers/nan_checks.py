"""``nan_policy`` on every rank of one torchrun job (float64, 2 ranks): a non-finite loss or gradient anywhere
raises on every rank before any optimizer steps, or skips the step on every rank alike.

Each check compares with the one-process model (``sw.build_model``): weights after a refused or skipped step
equal the weights before it, and a clean step after a skipped one matches the reference taking only that step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from worker import Check, Ctx, raises

D, CLASSES, M = 6, 3, 4
LR = 0.1


class SqrtAbs(nn.Module):
    """sqrt(|x|): a nonlinearity, finite where its input is not 0 (random inputs never are)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.abs().sqrt()


class _InfiniteGradient(torch.autograd.Function):
    """Zero forward; backward, a gradient of +inf for every element of its input, whatever flows back."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf"))


class InfGrad(nn.Module):
    """The identity, with a parameter ``poison`` whose gradient is exactly +inf in every backward.

    The loss stays finite and the infinity is there by construction, whatever the data and however a sum
    rounds. (It used to come from a pre-activation solved to be exactly 0 under sqrt(|x|): exact only where the
    pipeline's matmul summed in the order of the check's own dot product, which an AVX-512 Xeon's did not.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.poison = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + _InfiniteGradient.apply(self.poison)


def layers(middle: type[nn.Module] = SqrtAbs) -> list[sw.Layer]:
    """Five layers, two on stage 0 (rank 0): a Linear and ``middle``."""
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(middle),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.Tanh),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * M, D, dtype=torch.float64, generator=g), torch.randint(0, CLASSES, (2 * M,), generator=g)


def nan_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One NaN in sample 3: micro-batch 1 (2 samples per micro-batch)."""
    x, y = data(1)
    x[3, 2] = float("nan")
    return x, y


def pipeline(policy: str, factory: bool, middle: type[nn.Module] = SqrtAbs) -> sw.Pipeline:
    opt = (lambda ps: torch.optim.SGD(ps, lr=LR)) if factory else None
    return sw.Pipeline(
        layers(middle), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, partition=[2, 3], seed=5,
        optimizer=opt, nan_policy=policy, timeout=60.0,
    )  # fmt: skip


def snapshot(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.named_parameters()}


def same(pipe: sw.Pipeline, want: dict[str, torch.Tensor], what: str) -> None:
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-12, atol=1e-14, msg=lambda s, n=n: f"{what} {n}: {s}")


def nan_raises(factory: bool) -> Check:
    """A NaN input: every rank raises naming stage 1's loss for micro-batch 1; no weight moved."""

    def check(ctx: Ctx) -> None:
        pipe = pipeline("raise", factory)
        before = snapshot(pipe)
        x, y = nan_batch()
        named = ["stage 1's loss for micro-batch 1 is nan (rank 1)", "no optimizer stepped"]
        raises(sw.PipelineError, named, lambda: pipe.train_step(x, y))
        same(pipe, before, "after the refused step")
        assert all(p.grad is None for p in pipe.parameters()), "the refused step left its gradients"

    return check


def inf_gradient(ctx: Ctx) -> None:
    """A finite loss with an infinite gradient on stage 0 (rank 0): rank 1, all finite itself, raises too."""
    pipe = pipeline("raise", True, middle=InfGrad)
    before = snapshot(pipe)
    x, y = data(2)
    text = raises(sw.PipelineError, "stage 0: gradient 1.poison[0] = inf (rank 0)", lambda: pipe.train_step(x, y))
    assert "loss for micro-batch" not in text, text
    same(pipe, before, "after the refused step")


def skips(factory: bool) -> Check:
    """``skip``: the NaN step changes nothing on any rank and is counted; a clean step then matches the reference
    taking only that step (with the user's own optimizer too: the skipped step leaves no gradient to step)."""

    def check(ctx: Ctx) -> None:
        pipe = pipeline("skip", factory)
        ref = sw.build_model(layers(), seed=5)
        before = snapshot(pipe)
        user_opt = None if factory else torch.optim.SGD(pipe.parameters(), lr=LR)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        x, y = nan_batch()
        loss = pipe.train_step(x, y)
        assert loss != loss, f"the skipped step's loss should be NaN, got {loss}"
        assert pipe.skipped_steps == 1, pipe.skipped_steps
        assert all(p.grad is None for p in pipe.parameters()), "the skipped step left gradients"
        if user_opt is not None:
            user_opt.step()
            user_opt.zero_grad()
        same(pipe, before, "after the skipped step")
        x, y = data(3)
        loss = pipe.train_step(x, y)
        if user_opt is not None:
            user_opt.step()
            user_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert abs(loss - ref_loss.item()) < 1e-10, (loss, ref_loss.item())
        assert pipe.skipped_steps == 1, pipe.skipped_steps
        ref_params = dict(ref.named_parameters())
        same(pipe, {n: ref_params[n].detach() for n, _ in pipe.named_parameters()}, "after the clean step")

    return check


def bn_layers() -> list[sw.Layer]:
    """Two stages with a BatchNorm each: a NaN sample poisons its running statistics in the forward."""
    return [
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, dtype=torch.float64),
        sw.Layer(nn.Linear, D, D, dtype=torch.float64),
        sw.Layer(nn.BatchNorm1d, D, dtype=torch.float64),
        sw.Layer(nn.Tanh),
        sw.Layer(nn.Linear, D, CLASSES, dtype=torch.float64),
    ]


def buffers(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in pipe.named_buffers()}


def equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=lambda s, n=n: f"{what} {n}: {s}")


def nan_leaves_nothing(policy: str, mode: str) -> Check:
    """A NaN batch between two clean steps, under ``batchnorm=mode``: refused (``raise``) or skipped, it leaves
    the running statistics and every other buffer as they were and no gradient behind, so the run goes on
    exactly as a twin pipeline that never saw the NaN batch (same seed, the same clean steps)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        def make() -> sw.Pipeline:
            return sw.Pipeline(
                bn_layers(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=M, partition=[2, 4], seed=5,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), nan_policy=policy, batchnorm=mode, timeout=60.0,
            )  # fmt: skip

        pipe, twin = make(), make()
        for p in (pipe, twin):
            p.train_step(*data(1))
        before = buffers(pipe)
        assert before and all(torch.isfinite(b).all() for b in before.values()), before
        x, y = nan_batch()
        if policy == "raise":
            raises(sw.PipelineError, "non-finite values in the train step", lambda: pipe.train_step(x, y))
        else:
            pipe.train_step(x, y)
            assert pipe.skipped_steps == 1, pipe.skipped_steps
        equal(buffers(pipe), before, f"{policy}: the buffers after the NaN step")
        assert all(p.grad is None for p in pipe.parameters()), f"{policy}: the NaN step left gradients"
        for p in (pipe, twin):
            p.train_step(*data(3))
        equal(buffers(pipe), buffers(twin), f"{policy}: the buffers after the next clean step")
        equal(snapshot(pipe), snapshot(twin), f"{policy}: the weights after the next clean step")
        return {"buffers": len(before)}

    return check


def bad_policy(ctx: Ctx) -> None:
    named = "nan_policy must be one of ('raise', 'skip') or None (no check), got 'ignore'"
    raises(ValueError, named, lambda: pipeline("ignore", True))


def checks(world: int) -> dict[str, Check]:
    return {
        "raise-optimizer": nan_raises(True),
        "raise-user-optimizer": nan_raises(False),
        "inf-gradient": inf_gradient,
        "skip-optimizer": skips(True),
        "skip-user-optimizer": skips(False),
        "bad-policy": bad_policy,
        **{f"{p}-bn-{m}": nan_leaves_nothing(p, m) for p in ("raise", "skip") for m in ("micro", "deferred")},
    }
