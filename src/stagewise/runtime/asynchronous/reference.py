"""The one-process reference of asynchronous training: the rule of :mod:`stagewise.versions`, replayed plainly.

It shares no code with the pipelined run but the schedule's action order and
the prediction formula: it keeps *every* weight version of every stage (no
freeing), carries the version tag with each activation (vertical sync),
finds each version by counting the STEPs it has executed, and recomputes
every backward from the saved stage input on the version the rule names.
Actions run in the order the simulator times them (uniform costs): every
action starts after what it depends on has ended, so that order respects
every data dependency, and each stage sees its own actions in its rank's
order. Windows of the schedule's N mini-batches drain as the pipeline's do.

Stages hold tensors in, tensors out (one tensor between stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ...actions import Kind
from ...partition import uniform_counts
from ...schedule import Schedule
from ...schedules.asynchronous import window_of
from ...simulate import simulate
from ...stage_counts import counts_to_ranges
from ...validate_versions import async_table
from ...versions import Version
from ..model.layers import Chain, Layers, build_model
from .predict import predict


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
) -> ReferenceRun:
    """Train ``build_model(layers, seed)`` on ``batches`` by ``schedule``'s weight-version rule, in one process.

    ``schedule``: an asynchronous schedule (its mini-batch count is the window).
    ``counts``: layers per stage (default: uniform, as the Pipeline's default).
    ``optimizer``: the per-stage factory the Pipeline gets.
    """
    table = async_table(schedule)
    if table is None:
        raise ValueError(f"schedule {schedule.name!r} is not asynchronous: async_reference replays version tables")
    model = build_model(layers, seed)
    children = list(model.named_children())
    p = schedule.num_stages
    ranges = counts_to_ranges(list(counts) if counts is not None else uniform_counts(len(children), p))
    stages = [Chain([children[k] for k in r]) for r in ranges]
    replay = _Replay(stages, optimizer, loss_fn)
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


class _Replay:
    def __init__(self, stages: list[Chain], optimizer: Callable[..., torch.optim.Optimizer], loss_fn: Any) -> None:
        self.stages = stages
        self.named = [[(n, q) for n, q in st.named_parameters()] for st in stages]
        self.opts = [optimizer([q for _, q in named if q.requires_grad]) for named in self.named]
        self.loss_fn = loss_fn
        self.made: list[int] = []

    def run(self, s: int, x: torch.Tensor, weights: list[torch.Tensor]) -> Any:
        return functional_call(self.stages[s], {n: w for (n, _), w in zip(self.named[s], weights)}, (x,))

    def window(self, schedule: Schedule, batches: list[tuple[torch.Tensor, torch.Tensor]], m: int) -> list[float]:
        table = async_table(schedule)
        assert table is not None
        p = schedule.num_stages
        policy = table.policy
        xs, ys, shares = [], [], []
        for inputs, targets in batches:
            xs += list(torch.tensor_split(inputs, m))
            pieces = list(torch.tensor_split(targets, m))
            ys += pieces
            shares += [len(y) / len(targets) for y in pieces]
        current = [0] * p
        kept: list[dict[Version, list[torch.Tensor]]] = [{} for _ in range(p)]
        for s in range(p):
            kept[s][Version(0)] = [q.detach().clone() for _, q in self.named[s]]
        chosen: dict[tuple[int, int], Version] = {}  # XPipe: mini-batch t's version at stage s, fixed at its first F
        sums: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(p)]
        acts: dict[tuple[int, int], Any] = {}  # (s, i) -> (stage input, tag)
        flow: dict[tuple[str, int, int], Any] = {}
        losses = [0.0] * len(batches)

        def version_for(s: int, i: int, kind: Kind, tag: int, forward: Version | None) -> Version:
            """The rule, stated per policy: what (s, i)'s F or B uses, from the replay's own counts."""
            t = i // m
            if policy in ("stash", "none"):
                if kind is Kind.B and policy == "stash":
                    assert forward is not None
                    return forward  # the stashed version of the forward
                return Version(current[s])  # the current weights
            if policy == "vertical":
                return Version(tag)
            if policy == "2bw":
                return Version(max(0, t - 1))
            if (s, t) not in chosen:  # predict: the bellwether fixes it
                chosen[(s, t)] = Version(current[s], t - current[s])
            return chosen[(s, t)]

        def weights(s: int, v: Version) -> list[torch.Tensor]:
            if v not in kept[s]:
                assert v.base == current[s], f"stage {s}: {v} asked for at W^({current[s]})"
                params = [q for _, q in self.named[s]]
                kept[s][v] = predict(self.opts[s], params, v.ahead)  # type: ignore[arg-type]
            return kept[s][v]

        timed = simulate(schedule)
        order = sorted(
            (start, rank, j, a)
            for rank, (row, starts) in enumerate(zip(timed.actions, timed.starts))
            for j, (a, start) in enumerate(zip(row, starts))
        )
        for _, _, _, a in order:
            s, i = a.stage, a.microbatch
            if a.kind is Kind.F:
                assert i is not None
                x, tag = (xs[i], current[0]) if s == 0 else flow.pop(("F", s - 1, i))
                v = version_for(s, i, Kind.F, tag, None)
                with torch.no_grad():
                    out = self.run(s, x, weights(s, v))
                acts[(s, i)] = (x, tag, v)
                if s == p - 1:
                    losses[i // m] += float(self.loss_fn(out, ys[i])) * shares[i]
                else:
                    flow[("F", s, i)] = (out, tag)
            elif a.kind is Kind.B:
                assert i is not None
                x, tag, v_f = acts.pop((s, i))
                v = version_for(s, i, Kind.B, tag, v_f)
                leaves = [w.detach().requires_grad_(q.requires_grad) for w, (_, q) in zip(weights(s, v), self.named[s])]
                x_leaf = x.detach().requires_grad_(s > 0)
                out = self.run(s, x_leaf, leaves)
                if s == p - 1:
                    root, grad = self.loss_fn(out, ys[i]) * shares[i], None
                else:
                    root, grad = out, flow.pop(("B", s + 1, i))
                wanted = ([x_leaf] if s > 0 else []) + [w for w in leaves if w.requires_grad]
                got = torch.autograd.grad(root, wanted, grad, allow_unused=True)
                if s > 0:
                    flow[("B", s, i)], got = got[0], got[1:]
                t = i // m
                total = sums[s].setdefault(t, [torch.zeros_like(w) for w in leaves if w.requires_grad])
                for k, g in enumerate(got):
                    if g is not None:
                        total[k] += g
            elif a.kind is Kind.STEP:
                t = current[s]
                trained = [q for _, q in self.named[s] if q.requires_grad]
                for q, g in zip(trained, sums[s].pop(t)):
                    q.grad = g
                self.opts[s].step()
                self.opts[s].zero_grad(set_to_none=True)
                current[s] += 1
                kept[s][Version(current[s])] = [q.detach().clone() for _, q in self.named[s]]
        self.made = list(current)
        return losses
