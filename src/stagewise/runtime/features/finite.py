"""Non-finite losses and gradients: found anywhere in the mesh at the step, before any optimizer steps.

One NaN in a batch makes the loss, every gradient and (after the optimizer)
every weight NaN, silently. So at the end of a train step, once every
gradient is final (tied sums and the hybrid axes' reductions waited for),
each rank folds "is anything of mine non-finite" into one float on the
device - no host sync per tensor - and one all-reduce over the pipeline group
(through its transport; then over the mesh's other axes with ``parallel=``)
tells every rank the same answer; one
``.item()`` reads it. Only when the answer is "yes" do the ranks look closer
and gather where (the failing path, where cost does not matter).

``nan_policy="raise"``: every rank raises :class:`PipelineError` naming the
stage, the micro-batch and the first non-finite value, and no optimizer has
stepped. ``"skip"``: every rank drops the step's gradients (so neither the
schedule's STEP actions nor an optimizer the user steps after ``train_step``
changes a weight) and counts the step in ``Pipeline.skipped_steps``.

In a gradient merge (:mod:`.merge`) the check belongs to the step that reduces and steps, the last: the
merged steps before it are not checked (their gradients are partial sums, and a NaN or an infinity in
one stays in the sum), their losses are kept and checked with the last step's, and a refused or skipped
merge drops the gradients of all its steps and puts the buffers back as its first step found them.

Either way the step leaves nothing behind: the forwards already changed the
module buffers (BatchNorm's running statistics, torch's own update or the
deferred commit at SYNC; any module's in-place statistics), so every buffer of
this rank is put back as the step found it (:class:`Buffers`); and a refused
step's gradients go too (``"raise"``), so the next clean step is not refused
for the NaN gradients this one accumulated.

So that the check comes before any optimizer step while the runtime executes
exactly its schedule, a checking Pipeline with an optimizer factory has its
STEP actions placed at the end of each rank's list
(:func:`stagewise.passes.lowering.add_optimizer_steps` with ``at_end=True``), and the
first STEP runs the check (:class:`FinitePart` is a part of the SYNC/STEP hooks and
of every step); the steps' overlap with the drain is what this costs.
``nan_policy=None`` checks nothing and places each stage's STEP right after its SYNC.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...parallel import AXES
from ..errors import PipelineError
from .merge import GradientMerge

if TYPE_CHECKING:
    from ..engine.run import Run

POLICIES = ("raise", "skip")


def check_policy(policy: str | None) -> None:
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"nan_policy must be one of {POLICIES} or None (no check), got {policy!r}")


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's own piece
    return to_local() if callable(to_local) else t


def _screen(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor that is non-finite if ``t`` holds a NaN or an infinity: its sum.

    One read of the tensor and no temporaries (``isfinite(t).any()`` costs
    ~40x more on CPU: 3.2 ms against 77 us for 2**20 floats). A NaN or an
    infinity always makes the sum non-finite; a finite tensor whose sum
    overflows is a false alarm, which :class:`FiniteCheck` clears with the
    exact test. Half-precision sums accumulate in float32, so they overflow
    only where float32 would.
    """
    half = t.dtype in (torch.float16, torch.bfloat16)
    return t.sum(dtype=torch.float32 if half else None).to(torch.float64)


def any_non_finite(losses: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A one-element float64 tensor on ``device``: 1 if the screen of any loss or gradient here is not finite.

    The screen (:func:`_screen`) never misses a NaN or an infinity; it can
    flag a finite tensor whose sum overflows, which :func:`findings` (exact)
    then finds clean.
    """
    flag = torch.zeros(1, dtype=torch.float64, device=device)
    sums = [loss.detach().reshape(()).to(torch.float64) for loss in losses]
    for g in grads:
        part = _local(g)
        if part.numel():
            sums.append(_screen(part.detach()).to(device))
    if sums:
        flag += (~torch.isfinite(torch.stack([s.to(device) for s in sums]))).any()
    return flag


def findings(
    rank: int,
    losses: dict[Any, torch.Tensor],
    named: Sequence[tuple[str, nn.Parameter]],
    stage_of: dict[int, int],
    last_stage: int | None,
) -> dict[str, Any]:
    """Where this rank's first non-finite loss and gradient are (plain data, to gather); host syncs are fine here.

    ``losses`` by micro-batch, or by ``(merged step, micro-batch)`` in a gradient merge."""
    out: dict[str, Any] = {"rank": rank, "loss": None, "grad": None}
    for i in sorted(losses):
        value = float(losses[i])
        if not math.isfinite(value):
            out["loss"] = [last_stage, i, value]
            break
    for name, p in named:
        if p.grad is None:
            continue
        g = _local(p.grad).detach()
        bad = (~torch.isfinite(g)).reshape(-1).nonzero()
        if bad.numel():
            k = int(bad[0])
            out["grad"] = [stage_of.get(id(p)), name, k, float(g.reshape(-1)[k])]
            break
    return out


def message(
    everyone: list[dict[str, Any]], policy: str, where: str = "the train step", outcome: str | None = None
) -> str:
    """One text, alike on every rank, from every rank's :func:`findings`."""
    parts = []
    loss = next((f for f in everyone if f["loss"] is not None), None)
    grad = next((f for f in everyone if f["grad"] is not None), None)
    if loss is not None:
        stage, mb, value = loss["loss"]
        parts.append(f"stage {stage}'s loss for micro-batch {_microbatch(mb)} is {value} (rank {loss['rank']})")
    if grad is not None:
        stage, name, k, value = grad["grad"]
        place = "a tied module" if stage is None else f"stage {stage}"
        mb = "" if loss is None else f" (the first non-finite loss is micro-batch {_microbatch(loss['loss'][1])}'s)"
        parts.append(f"{place}: gradient {name}[{k}] = {value} (rank {grad['rank']}){mb}")
    found = "; ".join(parts) or "a non-finite value on some rank"
    what = outcome or ("no optimizer stepped" if policy == "raise" else "the step is skipped")
    return f"non-finite values in {where}: {found}; {what} (nan_policy={policy!r})"


def _microbatch(mb: Any) -> str:
    """A micro-batch as :func:`findings` gave it: its index, or (merged step, index) in a gradient merge."""
    if isinstance(mb, (list, tuple)):
        return f"{mb[1]} of the gradient merge's step {mb[0] + 1}"
    return str(mb)


class Buffers:
    """This rank's module buffers as the step found them, to put back when the step is refused or skipped.

    torch's kernels update BatchNorm's running statistics in place without bumping the tensors' version
    counters, so no buffer can be told unchanged cheaply: each one is copied at every checked step's start,
    into copies made once (one read and one write of the buffers; no allocation after the first step).
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.owners: list[nn.Module] = []  # every module once (a tied module may sit in two stages)
        seen: set[int] = set()
        for root in modules:
            for m in root.modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    self.owners.append(m)
        self.held: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []  # module, name, buffer, its copy

    @torch.no_grad()
    def take(self) -> None:
        """Copy every buffer (a buffer replaced or resized since the last step gets a new copy)."""
        found = [(m, n, b) for m in self.owners for n, b in m._buffers.items() if isinstance(b, torch.Tensor)]
        if len(found) != len(self.held) or any(b is not h[2] for (_, _, b), h in zip(found, self.held)):
            self.held = [(m, n, b, torch.empty_like(b)) for m, n, b in found]
        for _, _, b, copy in self.held:
            copy.copy_(b)

    @torch.no_grad()
    def restore(self) -> None:
        """Put every buffer back as :meth:`take` found it (the same tensor object, its values copied back)."""
        for m, n, b, copy in self.held:
            m._buffers[n] = b
            b.copy_(copy)


def drop_grads(params: Sequence[nn.Parameter]) -> None:
    """Forget the step's gradients, as a STEP's ``zero_grad(set_to_none=True)`` would (optimizers skip None)."""
    for p in params:
        p.grad = None


class FiniteCheck:
    """The step-end check of one rank (see the module docstring)."""

    def __init__(
        self,
        policy: str,
        rank: int,
        named: Sequence[tuple[str, nn.Parameter]],
        stage_of: dict[int, int],
        reduce: Callable[[torch.Tensor], None],
        gather: Callable[[Any], list[Any]],
        device: torch.device,
        post: Callable[[str], Any] | None = None,
        buffers: Buffers | None = None,
        merge: GradientMerge | None = None,
    ) -> None:
        check_policy(policy)
        self.merge = merge  # a gradient merge: only its last step checks, with every merged step's losses
        self.carried: list[dict[int, torch.Tensor]] = []  # the losses of the merged steps so far
        self.post = post  # posts a failure found on this rank alone on the error board
        self.buffers = buffers  # this rank's module buffers, put back when a step is refused or skipped
        self.policy = policy
        self.rank = rank
        self.named = list(named)
        self.stage_of = stage_of
        self.reduce = reduce
        self.gather = gather
        self.device = device
        self.skipped = 0

    def begin(self) -> None:
        """A train step (or an asynchronous window) starts: note the buffers it may have to put back (in a gradient
        merge, as its first step finds them)."""
        if self.buffers is not None and (self.merge is None or self.merge.first()):
            self.buffers.take()

    def undo(self) -> None:
        """The step is refused or skipped: its buffers back as they were, its gradients gone (a merge's, all)."""
        if self.buffers is not None:
            self.buffers.restore()
        drop_grads([p for _, p in self.named])
        self.carried = []

    def check_stage(self, stage: int, minibatch: int, losses: dict[int, torch.Tensor]) -> None:
        """An asynchronous window's STEP of ``stage`` for mini-batch ``minibatch`` of the stream: this stage's own
        gradients (and, on the last stage, that mini-batch's losses), checked here alone, before the stage's
        optimizer steps. Only ``"raise"``: the stages step at different times, so no rank can skip a
        mini-batch on every rank (:mod:`..assembly.combinations` refuses ``"skip"``); the failure is posted and every
        rank stops, naming this one."""
        mine = [(n, p) for n, p in self.named if self.stage_of.get(id(p)) == stage]
        grads = [p.grad for _, p in mine if p.grad is not None]
        flag = any_non_finite([losses[i] for i in sorted(losses)], grads, self.device)
        if float(flag.item()) == 0.0:
            return
        found = findings(self.rank, losses, mine, self.stage_of, stage if losses else None)
        if found["loss"] is None and found["grad"] is None:
            return  # only an overflowing sum: every value is finite
        text = message([found], self.policy, f"mini-batch {minibatch} of the stream", f"stage {stage} did not step")
        self.undo()
        if self.post is not None:
            self.post(f"rank {self.rank}: {text}")  # the others learn it at their next wait, naming this rank
        raise PipelineError(text)

    def __call__(self, losses: dict[int, torch.Tensor], last_stage: int | None, accumulate: bool = False) -> bool:
        """True if the step must be skipped; raises under ``"raise"``; False when every value is finite (or the step
        only accumulates, ``accumulate``, in a gradient merge: its losses wait for the merge's last)."""
        if accumulate:
            self.carried.append(dict(losses))
            return False
        if self.carried:
            merged = {(j, i): v for j, step in enumerate([*self.carried, losses]) for i, v in step.items()}
            self.carried = []
            return self._check(merged, last_stage)
        return self._check(losses, last_stage)

    def _check(self, losses: dict[Any, torch.Tensor], last_stage: int | None) -> bool:
        grads = [p.grad for _, p in self.named if p.grad is not None]
        flag = any_non_finite([losses[i] for i in sorted(losses)], grads, self.device)
        self.reduce(flag)
        if float(flag.item()) == 0.0:
            return False
        everyone = self.gather(findings(self.rank, losses, self.named, self.stage_of, last_stage))
        if all(f["loss"] is None and f["grad"] is None for f in everyone):
            return False  # only an overflowing sum: every value is finite
        text = message(everyone, self.policy)
        self.undo()
        if self.policy == "raise":
            raise PipelineError(text)
        self.skipped += 1
        return True


class FinitePart:
    """The check as a part of the pipeline: of each stage's STEP (:class:`~..engine.hooks.StagePart`) and of each
    train step (:class:`~..engine.runner.StepPart`).

    Synchronous schedules: once per train step, collectively, at the step's first STEP (the schedule puts them at
    the end of each rank's list when checking) or, with no STEP in the list (no optimizer factory), after the
    step. Every gradient must be final first: ``settle()`` waits for the tied sums and the hybrid axes'
    reductions. Asynchronous schedules: each stage's own mini-batch at each of its STEPs, after
    ``settle_stage(stage)`` (no collective: the stages step at different times).
    """

    def __init__(
        self,
        check: FiniteCheck,
        *,
        placement: Sequence[int],
        asynchronous: bool,
        settle: Callable[[], None],
        settle_stage: Callable[[int], None],
    ) -> None:
        self.check = check
        self.placement = placement
        self.asynchronous = asynchronous
        self.settle = settle
        self.settle_stage = settle_stage
        self.run: Run | None = None  # the train step running (or the last one)
        self.checked = False  # whether this synchronous train step's collective check has run
        self.stepped: dict[int, int] = {}  # STEPs each stage ran in this asynchronous window

    @property
    def skipped(self) -> int:
        return self.check.skipped

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        if run.mode == "train":
            self.run, self.checked, self.stepped = run, False, {}
            self.check.begin()  # the buffers as they are: a refused or skipped step puts them back
        yield

    def after(self, run: Run) -> None:
        if run.mode == "train":
            self._check_step()  # when the list had no STEP (no optimizer factory), the check runs here

    def on_sync(self, run: Run, stage: int) -> None:
        """Nothing at SYNC: the gradients are not final yet."""

    def before_step(self, run: Run, stage: int) -> None:
        if self.run is None:
            return
        if not self.asynchronous:
            self._check_step()
            return
        k = self.stepped.get(stage, 0)
        self.stepped[stage] = k + 1
        self.settle_stage(stage)
        m = self.run.per_minibatch
        last = stage == len(self.placement) - 1
        losses = {i: v for i, v in self.run.record.losses.items() if i // m == k} if last else {}
        self.check.check_stage(stage, self.run.first + k, losses)

    def _check_step(self) -> None:
        if self.asynchronous or self.checked or self.run is None:
            return
        self.checked = True
        accumulate = self.run.accumulate
        if not accumulate:  # (a merge's step started no reduction: nothing to wait for)
            self.settle()
        last = self.placement[-1] == self.check.rank
        self.check(self.run.record.losses if last else {}, len(self.placement) - 1 if last else None, accumulate)


def finite_check(
    policy: str | None,
    stages: Mapping[int, Any],
    rank: int,
    device: torch.device,
    transport: Any,
    hybrid: Any,
    named: Sequence[tuple[str, nn.Parameter]],
    merge: GradientMerge | None = None,
) -> FiniteCheck | None:
    """The check for a pipeline (None for ``nan_policy=None``): reduced over the whole mesh (or the pipeline
    group), within its deadline. ``stages``: this rank's (each with its ``modules``); ``named``: the pipeline's
    parameters under their one-process names; ``merge``: the pipeline's gradient merge (:mod:`.merge`)."""
    if policy is None:
        return None
    from ..comm.collectives import gather_json

    stage_of = {id(p): s for s, st in stages.items() for m in st.modules for p in m.parameters()}
    group = None if hybrid is not None else transport.group  # the mesh spans the world

    def reduce(flag: torch.Tensor) -> None:
        # over the pipeline's group through its own transport (shared memory where the ranks share a host: a gloo
        # all-reduce of the pp axis took ~1 ms on 4 ranks of a 2-core host, at the end of every step), then over
        # the mesh's other axes; the flag counts ranks, so the sum is exact in any order
        transport.all_reduce(flag, "sum", "the check for non-finite values")
        if hybrid is not None:
            hybrid.reduce(flag, "sum", tuple(a for a in AXES if a != "pp"))

    def gather(obj: Any) -> list[Any]:
        return gather_json(obj, group, transport.guard.wait, "where the non-finite values are")

    buffers = Buffers([m for st in stages.values() for m in st.modules])
    return FiniteCheck(policy, rank, named, stage_of, reduce, gather, device, transport.guard.fail, buffers, merge)
