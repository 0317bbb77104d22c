"""The one-process reference of asynchronous training: the rule of :mod:`stagewise.asynchronous.versions`,
replayed plainly.

It shares no code with the pipelined run but the schedule's action order and
the prediction formula: it keeps *every* weight version of every stage (no
freeing), carries the version tag with each activation (vertical sync),
finds each version by counting the STEPs it has executed, and recomputes
every backward from the saved stage input on the version the rule names.
Actions run in the order the simulator times them (uniform costs): every
action starts after what it depends on has ended, so that order respects
every data dependency, and each stage sees its own actions in its rank's
order. Windows of the schedule's N mini-batches drain as the pipeline's do.

What crosses a stage boundary may be any nesting of tensors (a Hugging Face stage hands on its hidden states,
mask and positions); the floating tensors carry the gradients back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from stagewise.asynchronous import Version
from stagewise.ir import Kind, Schedule
from stagewise.partition import counts_to_ranges, uniform_counts
from stagewise.runtime.asynchronous.predict import predict
from stagewise.runtime.frontends.layers import Chain, Layers
from stagewise.runtime.frontends.one_process import build_model
from stagewise.schedules import window_of
from stagewise.simulation import simulate
from stagewise.validate import async_table

from .async_reference_norms import ReplayNorms


@dataclass
class ReferenceRun:
    """The losses of each mini-batch, the trained one-process model, and every version each stage made."""

    losses: list[float]
    model: Chain
    versions_made: list[int]


def async_reference(
    layers: Layers,
    schedule: Schedule,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    seed: int = 0,
    counts: Sequence[int] | None = None,
    steps: int | None = None,
    batchnorm: str = "micro",
) -> ReferenceRun:
    """Train ``build_model(layers, seed)`` on ``batches`` by ``schedule``'s weight-version rule, in one process.

    ``schedule``: an asynchronous schedule (its mini-batch count is the window).
    ``counts``: layers per stage (default: uniform; give the pipeline's own, its ``layer_ranges``' lengths).
    ``optimizer``: the per-stage factory the Pipeline gets.
    ``batchnorm``: what BatchNorm's running statistics follow, as ``Pipeline(batchnorm=...)``
    (:mod:`.async_reference_norms`).
    """
    table = async_table(schedule)
    if table is None:
        raise ValueError(f"schedule {schedule.name!r} is not asynchronous: async_reference replays version tables")
    model = build_model(layers, seed)
    children = list(model.named_children())
    p = schedule.num_stages
    ranges = counts_to_ranges(list(counts) if counts is not None else uniform_counts(len(children), p))
    stages = [Chain([children[k] for k in r]) for r in ranges]
    replay = _Replay(stages, optimizer, loss_fn, batchnorm)
    window = table.minibatches
    todo = list(batches) if steps is None else list(batches)[:steps]
    losses: list[float] = []
    made = [0] * p
    for start in range(0, len(todo), window):
        chunk = todo[start : start + window]
        sched = schedule if len(chunk) == window else window_of(schedule, len(chunk))
        losses += replay.window(sched, chunk, table.microbatches)
        made = [a + b for a, b in zip(made, replay.made)]
    return ReferenceRun(losses, model, made)


def _floating(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a nested value, in flattening order (what carries a gradient)."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _as_leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each floating tensor replaced by a fresh leaf that requires grad (and those leaves)."""
    flat, spec = tree_flatten(value)
    leaves: list[torch.Tensor] = []
    out = []
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().requires_grad_(True)
            leaves.append(t)
        out.append(t)
    return tree_unflatten(out, spec), leaves


class _Replay:
    """The stages, their optimizers and the loss: what outlives a window."""

    def __init__(
        self,
        stages: list[Chain],
        optimizer: Callable[..., torch.optim.Optimizer],
        loss_fn: Any,
        batchnorm: str = "micro",
    ) -> None:
        self.stages = stages
        self.norms = ReplayNorms(list(stages), batchnorm)
        self.named = [[(n, q) for n, q in st.named_parameters()] for st in stages]
        self.opts = [optimizer([q for _, q in named if q.requires_grad]) for named in self.named]
        self.loss_fn = loss_fn
        self.made: list[int] = []

    def run(self, s: int, x: torch.Tensor, weights: list[torch.Tensor]) -> Any:
        return functional_call(self.stages[s], {n: w for (n, _), w in zip(self.named[s], weights)}, (x,))

    def window(self, schedule: Schedule, batches: list[tuple[torch.Tensor, torch.Tensor]], m: int) -> list[float]:
        """Replay one window of ``batches`` (N mini-batches of ``m`` micro-batches); each mini-batch's loss."""
        window = _Window(self, schedule, batches, m)
        timed = simulate(schedule)
        order = sorted(
            (start, rank, j, a)
            for rank, (row, starts) in enumerate(zip(timed.actions, timed.starts))
            for j, (a, start) in enumerate(zip(row, starts))
        )
        for _, _, _, a in order:
            if a.kind is Kind.F:
                window.forward(a.stage, a.microbatch)
            elif a.kind is Kind.B:
                window.backward(a.stage, a.microbatch)
            elif a.kind is Kind.STEP:
                window.step(a.stage)
        self.made = list(window.current)
        return window.losses


class _Window:
    """One window's state: the versions kept, the activations saved and the values in flight between stages."""

    def __init__(
        self, replay: _Replay, schedule: Schedule, batches: list[tuple[torch.Tensor, torch.Tensor]], m: int
    ) -> None:
        table = async_table(schedule)
        assert table is not None
        self.r, self.m, self.policy = replay, m, table.policy
        self.p = p = schedule.num_stages
        self.xs: list[torch.Tensor] = []
        self.ys: list[torch.Tensor] = []
        self.shares: list[float] = []  # each micro-batch's share of its mini-batch's loss
        for inputs, targets in batches:
            self.xs += list(torch.tensor_split(inputs, m))
            pieces = list(torch.tensor_split(targets, m))
            self.ys += pieces
            self.shares += [len(y) / len(targets) for y in pieces]
        self.current = [0] * p  # STEPs each stage has executed: its newest version
        self.kept: list[dict[Version, list[torch.Tensor]]] = [
            {Version(0): [q.detach().clone() for _, q in replay.named[s]]} for s in range(p)
        ]
        self.chosen: dict[tuple[int, int], Version] = {}  # XPipe: mini-batch t's version at stage s, fixed at its F
        self.sums: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(p)]
        self.acts: dict[tuple[int, int], Any] = {}  # (s, i) -> (stage input, tag, version)
        self.flow: dict[tuple[str, int, int], Any] = {}
        self.losses = [0.0] * len(batches)

    def version_for(self, s: int, i: int, kind: Kind, tag: int, forward: Version | None) -> Version:
        """The rule, stated per policy: what (s, i)'s F or B uses, from the replay's own counts."""
        t = i // self.m
        if self.policy in ("stash", "none"):
            if kind is Kind.B and self.policy == "stash":
                assert forward is not None
                return forward  # the stashed version of the forward
            return Version(self.current[s])  # the current weights
        if self.policy == "vertical":
            return Version(tag)
        if self.policy == "2bw":
            return Version(max(0, t - 1))
        if (s, t) not in self.chosen:  # predict: the bellwether fixes it
            self.chosen[(s, t)] = Version(self.current[s], t - self.current[s])
        return self.chosen[(s, t)]

    def weights(self, s: int, v: Version) -> list[torch.Tensor]:
        if v not in self.kept[s]:
            assert v.base == self.current[s], f"stage {s}: {v} asked for at W^({self.current[s]})"
            params = [q for _, q in self.r.named[s]]
            self.kept[s][v] = predict(self.r.opts[s], params, v.ahead)
        return self.kept[s][v]

    def forward(self, s: int, i: int | None) -> None:
        assert i is not None
        x, tag = (self.xs[i], self.current[0]) if s == 0 else self.flow.pop(("F", s - 1, i))
        v = self.version_for(s, i, Kind.F, tag, None)
        with torch.no_grad(), self.r.norms.forward(s, i // self.m):
            out = self.r.run(s, x, self.weights(s, v))
        self.acts[(s, i)] = (x, tag, v)
        if s == self.p - 1:
            self.losses[i // self.m] += float(self.r.loss_fn(out, self.ys[i])) * self.shares[i]
        else:
            self.flow[("F", s, i)] = (out, tag)

    def backward(self, s: int, i: int | None) -> None:
        """Recompute the forward on the version the rule names, then the gradients, summed per mini-batch."""
        assert i is not None
        x, tag, v_f = self.acts.pop((s, i))
        v = self.version_for(s, i, Kind.B, tag, v_f)
        named = self.r.named[s]
        leaves = [w.detach().requires_grad_(q.requires_grad) for w, (_, q) in zip(self.weights(s, v), named)]
        x_in, x_leaves = _as_leaves(x) if s > 0 else (x, [])
        with self.r.norms.quiet(s):
            out = self.r.run(s, x_in, leaves)
        if s == self.p - 1:
            roots, grads = [self.r.loss_fn(out, self.ys[i]) * self.shares[i]], None
        else:
            handed = self.flow.pop(("B", s + 1, i))  # one gradient per floating output, None where it needs none
            pairs = [(o, g) for o, g in zip(_floating(out), handed) if o.requires_grad and g is not None]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        wanted = x_leaves + [w for w in leaves if w.requires_grad]
        got = list(torch.autograd.grad(roots, wanted, grads, allow_unused=True)) if roots else [None] * len(wanted)
        if s > 0:
            self.flow[("B", s, i)], got = got[: len(x_leaves)], got[len(x_leaves) :]
        total = self.sums[s].setdefault(i // self.m, [torch.zeros_like(w) for w in leaves if w.requires_grad])
        for k, g in enumerate(got):
            if g is not None:
                total[k] += g

    def step(self, s: int) -> None:
        """Apply the oldest summed gradient of stage ``s``; its result is the next version."""
        trained = [q for _, q in self.r.named[s] if q.requires_grad]
        self.r.norms.step(s, self.current[s])
        for q, g in zip(trained, self.sums[s].pop(self.current[s])):
            q.grad = g
        self.r.opts[s].step()
        self.r.opts[s].zero_grad(set_to_none=True)
        self.current[s] += 1
        self.kept[s][Version(self.current[s])] = [q.detach().clone() for _, q in self.r.named[s]]
