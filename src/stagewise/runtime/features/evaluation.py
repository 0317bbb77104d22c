"""Evaluation: the loss of a batch on every rank, averaged over the replicas, and inputs shaped as in training.

:meth:`Pipeline.eval_loss` runs the forward-only schedule (``eval_step``), computes ``loss_fn`` on the last
stage's rank over the whole batch's outputs, and shares it: over the pipeline group, then over the data-parallel
replicas, each weighted by what its mean is over (its rows, or ``loss_weights(targets)``'s total), so every rank
gets the global batch's mean - what ``loss_fn(model(inputs), targets)`` gives in one process.

:class:`InputStructure` (a step part) remembers the structure of the first training micro-batch's inputs (the
containers, the number of tensors, each one's dtype and number of dims) and refuses an ``eval_step`` whose inputs
differ, on the rank holding stage 0, before any message of the schedule is sent (:mod:`..engine.eval_inputs`:
every rank raises it and the pipeline stays usable), instead of a stage failing half-way through the
communication.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from ..comm.faults import calls
from ..engine.batches import to_device
from ..engine.microbatch import batch_size
from ..engine.tree import flatten, leaf_paths, same_spec


def describe(value: Any) -> tuple[Any, tuple[tuple[torch.dtype, int], ...]]:
    """The structure of one micro-batch's inputs: its spec and each tensor's (dtype, dims)."""
    leaves, spec = flatten(value)
    return spec, tuple((t.dtype, t.dim()) for t in leaves)


def _words(described: tuple[Any, tuple[tuple[torch.dtype, int], ...]]) -> str:
    spec, leaves = described
    paths = leaf_paths(spec, "inputs")
    return ", ".join(f"{p}: {str(d).removeprefix('torch.')} {n}-d" for p, (d, n) in zip(paths, leaves)) or "no tensor"


class InputStructure:
    """A step part: a train step's first inputs define the structure; an eval with other inputs is refused."""

    def __init__(self) -> None:
        self.trained: tuple[Any, tuple[tuple[torch.dtype, int], ...]] | None = None

    @contextmanager
    def around(self, run: Any) -> Iterator[None]:
        inputs = run.record.inputs
        if inputs and run.mode == "train" and self.trained is None:  # the rank holding stage 0
            self.trained = describe(inputs[0])
        yield

    def check_eval(self, record: Any) -> None:
        """An evaluation's inputs, on the rank holding stage 0 before anything is sent
        (:mod:`..engine.eval_inputs`: refused alike on every rank, the pipeline still usable)."""
        if record.inputs and self.trained is not None:
            self.refuse(describe(record.inputs[0]))

    def after(self, run: Any) -> None:
        """(Nothing after a step.)"""

    def refuse(self, seen: tuple[Any, tuple[tuple[torch.dtype, int], ...]]) -> None:
        assert self.trained is not None
        if same_spec(seen[0], self.trained[0]) and seen[1] == self.trained[1]:
            return
        raise ValueError(
            f"eval_step: the inputs differ from training's: trained on ({_words(self.trained)}), evaluated on "
            f"({_words(seen)}); give eval_step inputs of the training's structure (the same containers, tensors, "
            "dtypes and dims; other sizes are fine)"
        )


def eval_loss(pipe: Any, inputs: Any, targets: Any) -> float:
    """:meth:`Pipeline.eval_loss`: the global batch's mean ``loss_fn`` on every rank (a collective)."""
    with calls.call("eval_loss", pipe.transport.guard.scope):
        return _eval_loss(pipe, inputs, targets)


def _eval_loss(pipe: Any, inputs: Any, targets: Any) -> float:
    options = pipe.options
    if options.loss_fn is None:
        raise ValueError("eval_loss needs loss_fn= (the Pipeline's own loss): build the Pipeline with one")
    owner = pipe.schedule.placement[-1]
    if pipe.rank == owner and targets is None:  # said before the forwards: every rank stops at once
        _fail(pipe, ValueError(f"rank {pipe.rank} holds the last stage, so eval_loss needs the targets"))
    outputs = pipe.eval_step(inputs)
    buf = torch.zeros(2, dtype=torch.float64, device=pipe.device)
    if pipe.rank == owner:
        try:
            buf[0], buf[1] = _weighted_loss(options, outputs, to_device(targets, pipe.device))
        except Exception as err:  # the others wait for this loss: they stop with this error, not at the deadline
            _fail(pipe, err)
    if pipe.num_ranks > 1:
        pipe.transport.broadcast(buf, owner, f"the evaluation loss from rank {owner}")
    if pipe.hybrid is not None and pipe.hybrid.config.replicas > 1:
        pipe.hybrid.mesh.all_reduce(buf, ("dp", "sharding"), wait=pipe.transport.guard.wait, what="the eval loss")
    total, weight = buf.tolist()
    return total / weight


def _weighted_loss(options: Any, outputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's rank: the batch's loss times its weight (its rows, or ``loss_weights``'s total), and the
    weight."""
    with torch.no_grad():
        loss = options.loss_fn(outputs, targets)
    if options.loss_weights is not None:
        weight = torch.as_tensor(options.loss_weights(targets), dtype=torch.float64).sum()
    else:
        weight = torch.tensor(float(batch_size(targets, options.target_batch_dim, "targets")), dtype=torch.float64)
    return loss.detach().to(torch.float64) * weight, weight


def _fail(pipe: Any, err: Exception) -> NoReturn:
    """Post ``err`` to the pipeline's board, so that every rank waiting in this evaluation raises it at once,
    then raise it here."""
    pipe.transport.guard.fail_with(err)
    raise err
