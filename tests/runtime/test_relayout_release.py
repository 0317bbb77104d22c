"""After a successful ``pipe.relayout``, the old layout's tensors go at once (its cycles are cut, no garbage
collection needed), and the modules the new layout shares with it (a user's own stages) keep their hooks."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw


def _refs(pipe: sw.Pipeline) -> dict[str, weakref.ref[torch.Tensor]]:
    """Weak references to the pipeline's parameters, gradients, buffers and optimizer state."""
    refs = {f"param/{n}": weakref.ref(p) for n, p in pipe.named_parameters()}
    refs |= {f"grad/{n}": weakref.ref(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
    refs |= {f"buffer/{n}": weakref.ref(b) for n, b in pipe.named_buffers()}
    for s, opt in pipe.optimizers.items():
        for i, entries in enumerate(opt.state.values()):
            refs |= {f"optim/{s}/{i}/{k}": weakref.ref(v) for k, v in entries.items() if isinstance(v, torch.Tensor)}
    return refs


def _held(pipe: sw.Pipeline) -> set[int]:
    """The tensors the new layout holds (an old one it took as it is may stay alive)."""
    held = {id(t) for t in (*pipe.parameters(), *pipe.buffers())}
    held |= {id(p.grad) for p in pipe.parameters() if p.grad is not None}
    for opt in pipe.optimizers.values():
        held |= {id(v) for entries in opt.state.values() for v in entries.values() if isinstance(v, torch.Tensor)}
    return held


def test_the_old_layouts_tensors_go_at_once_after_a_relayout(one_rank: object) -> None:
    layers = [sw.Layer(nn.Linear, 4, 8), sw.Layer(nn.BatchNorm1d, 8), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 8, 3)]
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, microbatches=2, batchnorm="micro",
        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
    )  # fmt: skip
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        pipe.train_step(x, y)
    refs = _refs(pipe)
    assert any(n.startswith("param/") for n in refs) and any(n.startswith("optim/") for n in refs)
    gc.collect()
    gc.disable()
    try:
        pipe.relayout(microbatches=1)
        held = _held(pipe)
        alive = sorted(n for n, r in refs.items() if r() is not None and id(r()) not in held)
        assert alive == [], f"the old layout's tensors are still alive after the re-layout: {alive}"
    finally:
        gc.enable()
    pipe.train_step(x, y)  # the new layout trains


def test_a_user_held_stage_keeps_its_hooks_across_a_relayout(one_rank: object) -> None:
    """``from_stages``: the new layout holds the user's own modules; the old layout's let-go leaves them whole
    (stagewise's BatchNorm hooks on them are the new layout's too), and the next step equals a pipeline built
    directly at the new options from the same state."""

    def stage(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def build(module: nn.Module, schedule: str) -> sw.Pipeline:
        return sw.Pipeline.from_stages(
            {0: module}, loss_fn=F.cross_entropy, microbatches=2, schedule=schedule, batchnorm="deferred"
        )

    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
    mine = stage(0)
    pipe = build(mine, "1f1b")
    pipe.train_step(x, y)
    hooks = {n: len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in mine.named_modules()}
    pipe.relayout(schedule="gpipe")
    assert {n: len(m._forward_pre_hooks) + len(m._forward_hooks) for n, m in mine.named_modules()} == hooks
    twin = stage(0)
    twin.load_state_dict(mine.state_dict())
    fresh = build(twin, "gpipe")
    assert pipe.train_step(x, y) == fresh.train_step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), twin.state_dict().values()))
