"""Seeded dropout in one process (issue 42): which modules are seeded, a one-rank pipeline of several stages against
``sw.runtime.seeded_dropout`` looping over the micro-batches, the global generator left as it was. The layouts
and schedules on 4 ranks: tests/distributed/workers/dropout_checks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.features.dropout import drops, key

D = 6


class Attention(nn.Module):
    """Calls the functional dropout with its own rate, as transformers' attentions do."""

    def __init__(self, rate: float = 0.25) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.attention_dropout = rate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.dropout(self.lin(h), p=self.attention_dropout, training=self.training)


class ChildRate(nn.Module):
    """Holds a dropout layer but hands its rate to the functional dropout, never calling it (transformers' GPT-2
    gives ``self.attn_dropout.p`` to ``scaled_dot_product_attention``)."""

    def __init__(self, rate: float = 0.2) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, dtype=torch.float64)
        self.attn_dropout = nn.Dropout(rate)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.dropout(self.lin(h), p=self.attn_dropout.p, training=self.training)


def layers() -> list[sw.Layer]:
    out: list[sw.Layer] = []
    for _ in range(3):
        out += [sw.Layer(nn.Linear, D, D, dtype=torch.float64), sw.Layer(nn.Dropout, 0.3), sw.Layer(Attention)]
    return [*out, sw.Layer(ChildRate), sw.Layer(nn.Linear, D, 3, dtype=torch.float64)]


def test_what_is_seeded() -> None:
    """Dropout layers with p > 0, modules holding a float rate named like one or a dropout child; not a rate of
    0, nor a rate under another name, nor an Identity, nor a container."""
    assert drops(nn.Dropout(0.1)) and drops(nn.AlphaDropout(0.2)) and drops(Attention())
    assert not drops(nn.Dropout(0.0)) and not drops(Attention(0.0)) and not drops(nn.Identity())
    assert drops(ChildRate()) and not drops(ChildRate(0.0))  # a dropout child: its p may be used without a call
    assert not drops(ChildRate(), root=True)  # the pipeline (or model) holding dropout layers is not seeded itself
    assert not drops(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))  # a container draws only through children
    weird = nn.Linear(2, 2)
    weird.rate = 0.5  # type: ignore[assignment]
    assert not drops(weird)
    assert key(0, 0, 0, 0, "1", 0) != key(0, 0, 0, 0, "1", 1) != key(0, 0, 1, 0, "1", 0)
    assert 0 <= key(2**70, 3, 4, 5, "x", 6) < 2**63


@pytest.mark.parametrize(("schedule", "v", "recompute"), [("interleaved-1f1b", 2, None), ("interleaved-1f1b", 3, 1)])
def test_one_rank_pipeline_draws_the_reference_masks(one_rank, schedule: str, v: int, recompute: int | None) -> None:
    """2 or 3 stages on one rank, recompute or not: losses and gradients equal the one-process loop's under
    seeded_dropout, and the global generator is where it was (the masks do not draw from it)."""
    x = torch.randn(10, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(10) % 3
    m = 4
    pipe = sw.Pipeline(
        layers(), loss_fn=F.cross_entropy, schedule=schedule, virtual_stages=v, microbatches=m, recompute=recompute,
        seed=2, dropout_seed=9,
    )  # fmt: skip
    ref = sw.build_model(layers(), seed=2)
    before = torch.get_rng_state()
    got = [pipe.train_step(x, y) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), before)
    want = []
    for step in range(2):
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.tensor_split(m), y.tensor_split(m))):
            with sw.runtime.seeded_dropout(ref, seed=9, step=step, microbatch=i):
                part = F.cross_entropy(ref(xi), yi) * len(yi) / len(y)
            part.backward()
            total += float(part.detach())
        want.append(total)
    assert got == pytest.approx(want, rel=1e-12) and got[0] != got[1]
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12)
    assert pipe.train_steps == 2


def test_mask_does_not_depend_on_the_input_memory_order() -> None:
    """A transpose's output and its contiguous copy (what a stage receives across a cut) get the same mask: torch
    draws in memory order, so the seeding hands the module a contiguous input."""
    model = nn.Sequential(nn.Dropout(0.5))
    h = torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    outs = []
    for x in (h, h.contiguous()):
        with sw.runtime.seeded_dropout(model, seed=4, step=1, microbatch=2):
            outs.append(model(x))
    assert not h.is_contiguous() and torch.equal(outs[0], outs[1])
    assert 0 < int((outs[0] == 0).sum()) < h.numel()
