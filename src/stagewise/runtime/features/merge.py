"""Gradient merge (DDP's ``no_sync``): train steps that only accumulate, reduced and stepped once, at the last.

Roughly::

    for k, (x, y) in enumerate(batches):
        if (k + 1) % K:
            with pipe.no_sync():          # accumulate: no reduction, no optimizer step
                pipe.train_step(x, y)
        else:
            pipe.train_step(x, y)         # the K-th: the merged gradient reduced once, then the STEP

Inside :meth:`Pipeline.no_sync` a ``train_step`` runs its whole schedule, but a stage's SYNC starts no
reduction - neither the data-parallel all-reduce (:mod:`..hybrid.data_parallel`), nor FSDP2's
reduce-scatter (:mod:`..hybrid.sharding`: its gradients stay unsharded and accumulate, as they do between
the micro-batches of one step), nor the tied sums (:mod:`..frontends.tied`) - the user's sync hooks do not
run (the gradients are not final) and STEP does not step the optimizer. The first ``train_step`` outside
reduces the gradients accumulated over every merged step, once, and steps. All of them are linear in the
gradient, so one reduction of the sum equals the sum of the per-step reductions: exact, with K - 1 fewer
all-reduces. The gradients add up as ``loss.backward()`` called once per batch does in one process (a sum
of each step's mean loss): divide the learning rate by K to average.

What belongs to the optimizer step happens once, on the merged gradient: the check of non-finite values
(``nan_policy``, :mod:`.finite`) runs at the last step, with every merged step's losses, and a refused or
skipped merge drops all of its gradients and puts the buffers back as its first step found them;
``clip_grad_norm_`` is refused until then, as a checkpoint is (it saves no gradients, and each replica's
partial sums are its own). Asynchronous schedules and HetPipe refuse ``no_sync`` (:mod:`..assembly.combinations`).

The merge is a part of every step (:class:`~..engine.runner.StepPart`, registered first): it says, on the run
value, whether the run only accumulates (``run.accumulate``, set as the run starts). That flag is the one the
other parts read - the SYNC and STEP handlers (:mod:`..engine.hooks`), the hybrid axes, the tied sums, the check
of non-finite values, the snapshots - and the merge is the only one that sets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.run import Run


class GradientMerge:
    """This rank's place in a gradient merge: whether steps defer their reduction, how many have so far."""

    def __init__(self) -> None:
        self.depth = 0  # nested no_sync blocks open
        self.pending = 0  # train steps whose gradients are accumulated, not yet reduced

    def deferring(self) -> bool:
        """Whether a step run now only accumulates (inside ``no_sync``)."""
        return self.depth > 0

    def first(self) -> bool:
        """Whether a step run now starts a merge (no gradient of an earlier step is pending)."""
        return self.pending == 0

    @contextmanager
    def around(self, run: Run) -> Iterator[None]:
        """A train run inside ``no_sync`` only accumulates: the flag every other part reads."""
        run.accumulate = run.mode == "train" and self.deferring()
        yield

    def after(self, run: Run) -> None:
        """(Counted by the pipeline once the step and its checks are through: :meth:`stepped`, :meth:`dropped`.)"""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def stepped(self) -> None:
        """A train step ended: one more pending, or (outside ``no_sync``) the merge reduced and done."""
        self.pending = self.pending + 1 if self.deferring() else 0

    def dropped(self) -> None:
        """The pending gradients were dropped (a step refused for non-finite values)."""
        self.pending = 0

    def refuse(self, what: str, why: str) -> None:
        """Raise if gradients of merged steps are pending (or a ``no_sync`` block is open): ``what`` cannot run."""
        if self.pending or self.deferring():
            steps = f"{self.pending} train_step{'s' if self.pending != 1 else ''}"
            raise ValueError(
                f"{what} inside a gradient merge (no_sync(); {steps} accumulated, not yet reduced): {why}; call it "
                "after the train_step outside no_sync() that ends the merge"
            )
