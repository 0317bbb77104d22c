"""One step's data: its mini-batches cut into micro-batches where they are needed, each loss weighted by its share.

A synchronous train step is one mini-batch; an asynchronous window is several, one after another (micro-batch
``i`` belongs to mini-batch ``i // m``). Either way each micro-batch's mean loss is weighted by its share of its
mini-batch: of the rows, or of ``loss_weights(targets)`` summed over the mini-batch's micro-batches (e.g.
non-ignored tokens; see :mod:`..losses`).

Counts that ``loss_weights`` returns as tensors stay on the device when the runner asks (``defer_checks``): a
read per micro-batch would stop the host until the device had caught up, every micro-batch. Their check (a
count >= 0, a total > 0) then travels with the step's losses, in the step's one read of the device
(:meth:`.runner.Runner.train`); until then a bad count makes every weight of the step NaN, so that a
``nan_policy`` refuses the step before any optimizer steps on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .microbatch import Dims, split
from .run import RunRecord

#: per mini-batch, its local total of counted items -> the total its weights divide by (over the replicas)
Denominators = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DeferredCounts:
    """Counts kept on the device: ``bad`` (0-dim) is true when one is < 0 or not finite, or a total is <= 0."""

    counts: torch.Tensor  # (mini-batches, micro-batches per mini-batch), float64
    totals: torch.Tensor  # what each mini-batch's weights divide by
    bad: torch.Tensor

    def error(self) -> ValueError:
        """What was wrong, read from the device (the failing path: it reads)."""
        counts, totals = self.counts.tolist(), self.totals.tolist()
        for t, row in enumerate(counts):
            for k, n in enumerate(row):
                if not n >= 0 or n == float("inf"):
                    return ValueError(
                        f"loss_weights returned {n} for micro-batch {t * len(row) + k}: expected a count >= 0"
                    )
            if not totals[t] > 0:
                return ValueError(f"loss_weights counted nothing to average over in mini-batch {t}: {row}")
        return ValueError(f"loss_weights: counts {counts} over totals {totals} were refused")


@dataclass(frozen=True)
class Batches:
    """How this rank cuts a step's mini-batches into micro-batches: :func:`prepare_window` with what is fixed
    when the pipeline is built.

    ``denominators``: a train step's weighted losses over every data-parallel replica (``loss_weights=``
    with replicas: the global batch's token mean), or None.
    """

    rank: int
    placement: Sequence[int]
    batch_dims: tuple[Dims, Dims]
    device: torch.device
    has_loss: bool
    loss_weights: Callable[[Any], Any] | None = None
    denominators: Denominators | None = None
    replicas: int = 1  # data-parallel replicas, each given its share of a global batch (named in errors)

    def prepare(self, mode: str, batches: Sequence[tuple[Any, Any]], num_microbatches: int) -> RunRecord:
        return prepare_window(
            mode,
            batches,
            rank=self.rank,
            placement=self.placement,
            num_microbatches=num_microbatches,
            batch_dims=self.batch_dims,
            device=self.device,
            has_loss=self.has_loss,
            loss_weights=self.loss_weights,
            denominators=self.denominators if mode == "train" else None,
            defer_checks=True,  # counts on the device stay there: no read per micro-batch (module docstring)
            replicas=self.replicas,
        )


def prepare_window(
    mode: str,
    batches: Sequence[tuple[Any, Any]],
    *,
    rank: int,
    placement: Sequence[int],
    num_microbatches: int,
    batch_dims: tuple[Dims, Dims],
    device: torch.device,
    has_loss: bool,
    loss_weights: Callable[[Any], Any] | None = None,
    denominators: Denominators | None = None,
    defer_checks: bool = False,
    replicas: int = 1,
) -> RunRecord:
    """The :class:`~.run.RunRecord` of ``rank`` for ``batches`` (``(inputs, targets)`` per mini-batch): inputs
    where stage 0 is, targets and loss weights where the last stage is.

    ``denominators``: what each mini-batch's weights divide by, from its local total (default: the total);
    data-parallel replicas make it the total over every replica, so the mean is the global batch's.
    ``defer_checks``: counts returned as tensors stay on the device (``step.weights`` 0-dim tensors), checked
    later through ``step.counts`` (see the module docstring); else each is read and checked here.
    ``replicas``: data-parallel replicas, each given its share of a global batch (named in errors).
    """
    m = num_microbatches
    first, last = rank == placement[0], rank == placement[-1]
    step = RunRecord(mode, [] if first else None, None, None)
    if mode == "train" and last:
        step.targets, step.weights = [], []
    counts: list[list[float]] = []
    for t, item in enumerate(batches):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"mini-batch {t} must be an (inputs, targets) pair, got {type(item).__name__}")
        inputs, targets = item
        where = f"{mode}_step" if len(batches) == 1 else f"mini-batch {t}"
        sizes = None
        if first:
            if inputs is None:
                raise ValueError(f"rank {rank} holds stage 0, so {where} needs the inputs")
            chunks, sizes = split(inputs, m, batch_dims[0], "inputs", replicas)
            step.inputs += [to_device(c, device) for c in chunks]  # type: ignore[operator]
        if step.targets is not None:
            if targets is None:
                raise ValueError(f"rank {rank} holds the last stage, so {where} needs the targets")
            if not has_loss:
                raise ValueError("training needs a loss: build the Pipeline with loss_fn=...")
            chunks, target_sizes = _targets(targets, sizes, m, batch_dims[1], replicas)
            step.targets += [to_device(c, device) for c in chunks]
            counted = [float(n) for n in target_sizes] if loss_weights is None else [loss_weights(c) for c in chunks]
            counts.append(counted)
    if step.weights is None:
        return step
    if defer_checks and any(isinstance(n, torch.Tensor) for row in counts for n in row):
        step.weights, step.counts = _deferred(counts, denominators, device)
    else:
        checked = [[_count(n, t * m + i) for i, n in enumerate(row)] for t, row in enumerate(counts)]
        step.weights += _weights(checked, denominators)
    return step


def _targets(targets: Any, sizes: list[int] | None, m: int, dims: Dims, replicas: int) -> tuple[list[Any], list[int]]:
    """``targets`` cut into ``m`` micro-batches and their sizes, which must be the inputs' (``sizes``) if known."""
    chunks, target_sizes = split(targets, m, dims, "targets", replicas)
    if sizes is not None and sizes != target_sizes:
        raise ValueError(f"inputs and targets disagree on the batch size: {sum(sizes)} vs {sum(target_sizes)}")
    return chunks, target_sizes


def prepare_step(
    mode: str,
    inputs: Any,
    targets: Any,
    **where: Any,
) -> RunRecord:
    """One mini-batch's :class:`~.run.RunRecord` (see :func:`prepare_window`)."""
    return prepare_window(mode, [(inputs, targets)], **where)


def _weights(counts: list[list[float]], denominators: Denominators | None) -> list[float]:
    totals = [sum(c) for c in counts]
    over = totals if denominators is None else denominators(torch.tensor(totals, dtype=torch.float64)).tolist()
    out: list[float] = []
    for t, (c, total) in enumerate(zip(counts, over)):
        if total <= 0:
            raise ValueError(f"loss_weights counted nothing to average over in mini-batch {t}: {c}")
        out += [n / total for n in c]
    return out


def _deferred(
    counts: list[list[Any]], denominators: Denominators | None, device: torch.device
) -> tuple[list[Any], DeferredCounts]:
    """The weights as 0-dim float64 tensors on ``device``, computed there (NaN if a count is bad), no read."""
    flat = [n if isinstance(n, torch.Tensor) else torch.tensor(float(n)) for row in counts for n in row]
    values = torch.stack([n.detach().reshape(()).to(device, torch.float64, non_blocking=True) for n in flat])
    per = values.view(len(counts), -1)
    totals = per.sum(1)
    over = totals if denominators is None else denominators(totals)
    bad = (~torch.isfinite(values) | (values < 0)).any() | (over <= 0).any()
    weights = torch.where(bad, torch.nan, per / over[:, None]).reshape(-1)
    return list(weights.unbind()), DeferredCounts(per, over, bad)


def _count(n: Any, i: int) -> float:
    """A count of micro-batch ``i`` (what ``loss_weights`` returned), read and checked: a finite number >= 0."""
    n = float(n.item() if isinstance(n, torch.Tensor) else n)
    if not n >= 0 or n == float("inf"):
        raise ValueError(f"loss_weights returned {n} for micro-batch {i}: expected a count >= 0")
    return n


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (tensors inside tuples, named tuples, lists and dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:  # torch: "Cannot copy out of meta tensor; no data!"
            raise ValueError(
                f"a batch holds a tensor on the meta device (shape {tuple(value.shape)}): it has a shape and no "
                "data; build the batch on the CPU or on the pipeline's device"
            )
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        moved = [to_device(v, device) for v in value]
        if isinstance(value, list):
            return moved
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
