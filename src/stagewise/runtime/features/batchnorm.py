"""BatchNorm under micro-batching: each micro-batch normalised alone, running statistics per step.

A pipeline runs a mini-batch as ``m`` micro-batches, one after another on
each stage. A BatchNorm layer in training mode therefore normalises each
micro-batch with that micro-batch's own mean and variance: the pipeline
cannot use the whole mini-batch's statistics, because stage ``s`` must hand
micro-batch 0 on to stage ``s+1`` (and, in 1F1B, start its backward) before
it has seen micro-batch ``m-1``; waiting would serialise the pipeline (GPipe,
Huang et al. 2019, Sec. 2.2, names the issue). The forward and the gradients
are those of the one-process model run micro-batch by micro-batch.

What ``Pipeline(batchnorm=...)`` chooses is what happens to the *running*
statistics, the ones eval mode normalises with:

* ``"micro"`` (today's behaviour, and the default): torch's own update, once
  per micro-batch, so after a step ``num_batches_tracked`` has grown by ``m``
  and the running mean and variance are an exponential average over
  micro-batches of size ``B/m`` (their variances are noisier than the batch's);
* ``"deferred"`` (torchgpipe's DeferredBatchNorm idea, Kim et al. 2020,
  Sec. 3.3): the forwards leave the running statistics alone; each layer
  accumulates its inputs' per-channel count, mean and sum of squared
  deviations over the step's micro-batches, combined exactly (Chan, Golub and
  LeVeque's pairwise update, in float64), and the stage commits them once, at
  its SYNC, with the layer's ``momentum`` (``momentum=None``: the cumulative
  average), the unbiased variance over the whole batch (``n - 1`` with ``n``
  the total count) and ``num_batches_tracked`` one higher: what one
  BatchNorm call on the concatenation of the micro-batches' inputs does.

With ``parallel=`` data-parallel or sharded replicas (``dp x sharding``) every
replica ends each step holding the same running statistics - what a
checkpoint, an evaluation on any replica and ``gather_state_dict`` need:
by default each layer's are averaged over the replicas (:meth:`BatchNorms.agree`;
PyTorch DDP broadcasts rank 0's buffers at each forward instead, timm's
``distribute_bn`` averages them). With ``BatchNormPolicy("deferred",
across_replicas=True)`` the accumulated moments are combined over the replicas
at SYNC before they are committed: the running statistics of the global batch,
exactly as the one-process model would have them.

Either way, a forward that a backward recomputes (``recompute=``), and the
I/W split of zero-bubble schedules (which re-runs no forward of its own, but
may trigger a checkpoint's recomputation twice, once for I and once for W),
leave the running statistics alone: only the schedule's F action of a
micro-batch counts. A layer in eval mode (frozen BatchNorm) or built with
``track_running_stats=False`` is left as it is. ``eval_step`` with the layers
in training mode (``pipe.train()``) normalises each micro-batch alone and
updates the running statistics as a train step's forwards do - once per
micro-batch, or once over the batch under ``"deferred"`` -, as a forward in
training mode does in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...ir import Kind
from ..comm import collectives, groups
from .batchnorm_moments import Moments, commit, sum_over_replicas

if TYPE_CHECKING:
    from ..engine.run import Run

log = logging.getLogger(__name__)

MODES = ("micro", "deferred")
_announced = False  # the detection message is logged once per process


@dataclass(frozen=True)
class BatchNormPolicy:
    """What a Pipeline does with the running statistics of its BatchNorm layers (see the module docstring).

    ``mode``: ``"micro"`` or ``"deferred"``. ``across_replicas`` (deferred
    only): combine the step's statistics over the data-parallel / sharded
    replicas of ``parallel=`` before committing them.
    """

    mode: str = "deferred"
    across_replicas: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batchnorm mode must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")
        if self.across_replicas and self.mode != "deferred":
            raise ValueError("BatchNormPolicy(across_replicas=True) needs mode='deferred'")


def check_batchnorm(value: Any) -> BatchNormPolicy | None:
    """The policy for ``Pipeline(batchnorm=value)``: None (not chosen), a mode name or a BatchNormPolicy."""
    if value is None or isinstance(value, BatchNormPolicy):
        return value
    if isinstance(value, str) and value in MODES:
        return BatchNormPolicy(value)
    raise ValueError(
        f"batchnorm= must be one of {', '.join(map(repr, MODES))} or a stagewise.runtime.BatchNormPolicy, got {value!r}"
    )


# ---- the pipeline's layers ------------------------------------------------------------
def batchnorm_layers(modules: Sequence[nn.Module]) -> list[_BatchNorm]:
    """Every BatchNorm (``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones) under ``modules``, once."""
    seen: set[int] = set()
    out = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, _BatchNorm) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


class BatchNorms:
    """This rank's BatchNorm layers, run under a policy by forward hooks.

    The run value's ``current`` says which action the rank runs: only an F
    counts as the micro-batch's forward; any other (B, I or W recomputing a
    checkpointed segment) runs the layer without touching its running
    statistics. Outside a step (the user calling the layers directly) the
    hooks do nothing.
    """

    def __init__(
        self,
        policy: BatchNormPolicy | None,
        stages: dict[int, list[nn.Module]],
        reduce: Callable[[torch.Tensor], Any] | None = None,
        replicas: int = 1,
    ) -> None:
        self.policy = policy
        self.deferred = policy is not None and policy.mode == "deferred"
        self.run: Run | None = None  # the run in progress (its current action)
        self.reduce = reduce if policy is not None and policy.across_replicas else None
        self.replicas = replicas  # ``reduce`` sums over this many replicas (see :meth:`agree`)
        self.averaging = reduce if replicas > 1 and self.reduce is None else None
        self.layers: dict[int, list[_BatchNorm]] = {}
        for s, modules in sorted(stages.items()):
            mine = [bn for bn in batchnorm_layers(modules) if all(bn not in v for v in self.layers.values())]
            if mine:
                self.layers[s] = mine
        #: (stage, mini-batch) -> id(layer) -> the mini-batch's moments so far
        self.pending: dict[tuple[int, int], dict[int, Moments]] = {}
        self.mode: str | None = None  # "train" / "eval" inside a step, else None
        self.committed: dict[int, int] = {}  # stage -> mini-batches committed in this step
        self.minibatches, self.per_minibatch = 1, 0
        self._muted: list[tuple[nn.Module, dict[str, torch.Tensor] | None]] = []  # layers to restore, innermost last
        self._alone: list[nn.Module] = []  # layers normalising one value per channel (see _normalise_alone)
        self._handles = []
        for s, layers in self.layers.items():
            for bn in layers:
                self._handles.append(bn.register_forward_pre_hook(self._before(s)))
                self._handles.append(bn.register_forward_hook(self._after, always_call=True))

    def summary(self) -> dict[int, dict[str, int]]:
        """``{stage: {layer class name: count}}`` of this rank's BatchNorm layers."""
        out: dict[int, dict[str, int]] = {}
        for s, layers in self.layers.items():
            for bn in layers:
                out.setdefault(s, {})
                out[s][type(bn).__name__] = out[s].get(type(bn).__name__, 0) + 1
        return out

    @contextmanager
    def step(self, mode: str, minibatches: int = 1, per_minibatch: int = 0) -> Iterator[None]:
        """Run one train or eval step of ``minibatches`` mini-batches (an asynchronous window has several) of
        ``per_minibatch`` micro-batches each; a train step commits, at its end, any mini-batch no SYNC did."""
        counted = mode == "train" or any(bn.training for layers in self.layers.values() for bn in layers)
        mode = "train" if self.deferred and counted else mode  # (a forward in training mode counts in eval_step too)
        self.mode, self.pending, self.committed = mode, {}, {}
        self.minibatches, self.per_minibatch = minibatches, per_minibatch
        try:
            yield
        finally:
            self.mode = None
            while self._muted:  # left muted by a forward that raised
                self._restore(*self._muted.pop())
            while self._alone:
                self._alone.pop().train(True)
        if mode == "train" and self.deferred:
            self.mode = mode
            for s in self.layers:
                while self.committed.get(s, 0) < self.minibatches:
                    self.commit(s)
            self.mode = None
        if self.averaging is not None:
            self.agree()

    @torch.no_grad()
    def agree(self) -> None:
        """Every replica the same running statistics (a checkpoint, an evaluation, ``gather_state_dict``): each
        training layer's averaged over the data-parallel / sharded replicas at the end of a step that may have
        changed them. ``"micro"``: the update is linear, so this is torch's per-micro-batch update with each
        micro-batch's statistics averaged over the replicas; ``"deferred"``: the replicas' estimates averaged
        (``across_replicas=True`` gets the global batch's exactly instead). Equal values stay bit for bit."""
        layers = [bn for ls in self.layers.values() for bn in ls if bn.training and bn.running_var is not None]
        if not layers or self.averaging is None:
            return
        buffers = [b for bn in layers for b in (bn.running_mean, bn.running_var) if b is not None]
        flat = torch.cat([b.reshape(-1).to(torch.float64) for b in buffers])
        self.averaging(flat)
        flat /= self.replicas
        for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
            b.copy_(value.view_as(b))

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        """A part of every step: the forwards of ``run`` counted under the policy (see :meth:`step`)."""
        self.run = run
        try:
            with self.step(run.mode, run.minibatches, run.per_minibatch):
                yield
        finally:
            self.run = None

    def after(self, run: Run) -> None:
        """Nothing left: a train step commits at its SYNCs, or as :meth:`step` ends."""

    def before_step(self, run: Run, stage: int) -> None:
        """Nothing to wait for: the commit happened at SYNC."""

    def on_sync(self, run: Run, stage: int) -> None:
        """SYNC: commit the stage's next mini-batch (see :meth:`commit`)."""
        self.commit(stage)

    def commit(self, stage: int) -> None:
        """SYNC: the stage's forwards of its next mini-batch are done; commit that mini-batch's statistics (over
        the replicas if asked). A synchronous step has one SYNC per stage; an asynchronous window one per
        mini-batch, in order."""
        if not self.deferred or self.mode != "train" or stage not in self.layers:
            return
        k = self.committed.get(stage, 0)
        if k >= self.minibatches:
            return
        self.committed[stage] = k + 1
        got = self.pending.pop((stage, k), {})
        running = [(bn, bn.running_var) for bn in self.layers[stage] if bn.running_var is not None]
        layers = [bn for bn, _ in running]
        parts = [got.get(id(bn)) or Moments.zeros(var.numel(), var.device) for bn, var in running]
        if self.reduce is not None:
            sum_over_replicas(parts, self.reduce)
        for bn, stats in zip(layers, parts):
            commit(bn, stats)

    def _before(self, stage: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(bn: nn.Module, args: tuple[Any, ...]) -> None:
            if self.mode is None or not bn.training or not bn.track_running_stats or bn.running_mean is None:
                return
            action = self.run.current if self.run is not None else None
            forward = action is not None and action.kind is Kind.F
            alone = forward and self.run is not None and self.run.mode == "eval" and _one_value(args[0])
            if forward and not self.deferred:
                if alone:
                    self._normalise_alone(bn)
                return  # "micro": torch's own update, once per micro-batch
            if not self.deferred:  # "micro", recomputed: run as the F did (checkpoint compares), then undo
                self._muted.append((bn, {k: b.clone() for k, b in bn.named_buffers(recurse=False)}))
                return
            bn.track_running_stats = False  # type: ignore[assignment]  # (a bool: torch stubs the attribute loosely)
            self._muted.append((bn, None))
            if forward and self.mode == "train":
                seen = Moments.of(args[0])
                k = action.microbatch // self.per_minibatch if self.per_minibatch else 0  # type: ignore[union-attr,operator]
                acc = self.pending.setdefault((stage, k), {}).setdefault(id(bn), seen)
                if acc is not seen:
                    acc.add(seen)
            if alone:
                self._normalise_alone(bn)

        return hook

    def _normalise_alone(self, bn: nn.Module) -> None:
        """A forward-only run's micro-batch with one value per channel (a DataLoader's short last batch cut into
        micro-batches, in ``update_bn`` or an ``eval_step`` in training mode): torch cannot normalise one value by
        its own statistics and would fail the whole pipeline, so this call normalises with the running ones and
        updates nothing (under ``"deferred"`` its values still count in the batch's moments)."""
        bn.train(False)
        self._alone.append(bn)

    def _after(self, bn: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if self._alone and self._alone[-1] is bn:
            self._alone.pop().train(True)
        if self._muted and self._muted[-1][0] is bn:
            self._restore(*self._muted.pop())

    @staticmethod
    @torch.no_grad()
    def _restore(bn: nn.Module, saved: dict[str, torch.Tensor] | None) -> None:
        if saved is None:
            bn.track_running_stats = True  # type: ignore[assignment]  # (a bool: torch stubs the attribute loosely)
            return
        for k, b in bn.named_buffers(recurse=False):
            b.copy_(saved[k])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def attach_batchnorms(
    policy: BatchNormPolicy | None,
    stages: dict[int, list[nn.Module]],
    *,
    hybrid: Any,
    group: Any,
    num_microbatches: int,
    wait: Callable[[Sequence[Any], str], None] | None = None,
) -> BatchNorms:
    """Run this rank's BatchNorm layers under ``policy``; if it was not chosen and there are some, say so once.

    A forward counts only inside F (the run value's current action). Without a policy this gathers, over
    ``group``, which stages hold BatchNorm, so that global rank 0 can tell.
    """
    reduce = None
    if hybrid is not None and hybrid.config.replicas > 1:
        mesh = hybrid.mesh
        # under the pipeline's deadline and error board: a replica that died or failed is reported, not waited on
        reduce = lambda t: mesh.all_reduce(t, ("dp", "sharding"), wait=wait, what="the BatchNorm statistics")  # noqa: E731
    norms = BatchNorms(policy, stages, reduce, hybrid.config.replicas if reduce is not None else 1)
    if policy is None:
        summary = {str(s): kinds for s, kinds in norms.summary().items()}  # JSON keys are strings
        everyone = collectives.gather_json(summary, group, wait, "which stages hold BatchNorm")
        found = {int(s): kinds for d in everyone for s, kinds in d.items()}
        if found and groups.global_rank() == 0:
            announce(found, num_microbatches)
    return norms


def announce(found: dict[int, dict[str, int]], microbatches: int) -> None:
    """The detection message (once per process): what micro-batching does to BatchNorm and how to choose."""
    global _announced
    if _announced:
        return
    _announced = True
    where = "; ".join(
        f"stage {s}: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) for s, kinds in sorted(found.items())
    )
    sync = any("SyncBatchNorm" in kinds for kinds in found.values())
    log.warning(
        "stagewise: the pipeline holds BatchNorm layers (%s). Under micro-batching each of the %d micro-batches "
        "is normalised with its own statistics, and by default (batchnorm='micro') the running statistics are "
        "updated once per micro-batch (num_batches_tracked grows by %d per step). Pass batchnorm='deferred' to "
        "update them once per step over the whole batch, as the one-process model does, or batchnorm='micro' to "
        "keep this behaviour and silence this message.%s",
        where,
        microbatches,
        microbatches,
        " SyncBatchNorm synchronises over its process_group in every training forward: only the ranks that hold "
        "its stage run it, so give it the stage's data-parallel group (or use BatchNorm with "
        "stagewise.runtime.BatchNormPolicy('deferred', across_replicas=True))."
        if sync
        else "",
    )


def _one_value(x: Any) -> bool:
    """A BatchNorm input with one value per channel, which torch refuses to normalise in training mode."""
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.numel() == x.shape[1]
