"""Hybrid parallelism for one Pipeline: which axis does what, and the operations that span every axis.

A :class:`~stagewise.Pipeline` built with ``parallel=`` runs its schedule on
the ``pp`` group of the mesh, and :class:`Hybrid` adds, per stage:

* ``tp > 1``: the layers named by the tensor-parallel plan are split (:mod:`.tensor_parallel`);
* ``sharding > 1``: every layer is an FSDP2 unit over ``(dp, sharding)``, reduced at SYNC (:mod:`.sharding`);
* otherwise ``dp > 1``: gradients averaged over ``dp`` in buckets started at SYNC (:mod:`.data_parallel`).

and makes the step's global quantities right with all four axes on: the loss
is the mean over the ``dp * sharding`` replicas, and the gradient norm counts
every gradient element once - summed over the stages (``pp``) and the pieces
(``sharding``, ``tp``), not over the copies (``dp``, and whatever is
replicated). Checkpoint names are the one-process model's on every axis: a
split parameter is a DTensor under its own name.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...parallel import AXES, ParallelConfig
from ..comm import groups
from ..engine.microbatch import Dims, split
from . import sharding as zero
from .data_parallel import GradAverager, Wait
from .mesh import Mesh, build_mesh
from .tensor_parallel import TPPlan, align_grad, apply_plan, pieces

if TYPE_CHECKING:
    from ..engine.run import Run


class Hybrid:
    """The data, sharding and tensor-parallel parts of one Pipeline on a :class:`Mesh`."""

    def __init__(self, parallel: ParallelConfig | Mesh) -> None:
        if isinstance(parallel, ParallelConfig):
            parallel = build_mesh(parallel)
        if not isinstance(parallel, Mesh):
            raise TypeError(f"parallel= takes a stagewise.ParallelConfig or Mesh, got {type(parallel).__name__}")
        self.mesh = parallel
        self.config = parallel.config
        self.tp_split: list[str] = []
        self._units: dict[int, list[Any]] = {}
        self._split_params: dict[int, list[nn.Parameter]] = {}
        self._averager: GradAverager | None = None
        self._wait: Wait | None = None  # the pipeline's deadline wait, for the reductions issued here

    @property
    def pp_group(self) -> Any:
        return self.mesh.group("pp")

    def board_name(self) -> str:
        """The error board shared by every pipeline of one Pipeline built on the mesh (one per pp group).

        A failure in one replica then stops the others at their next wait, rather than at a deadline.
        """
        self.mesh.pipelines_made += 1
        return f"mesh{self.mesh.id}/pipeline{self.mesh.pipelines_made - 1}"

    # ---- building --------------------------------------------------------
    def require_plan(self, tp_plan: TPPlan | None) -> None:
        """Refuse tp > 1 without a plan: every rank alike, before any collective (see :func:`..assembly.assemble`)."""
        if self.config.tp > 1 and tp_plan is None:
            raise ValueError(f"tp={self.config.tp} needs a tp_plan= saying which layers to split")

    def attach(
        self,
        root: nn.Module,
        stages: dict[int, list[nn.Module]],
        tp_plan: TPPlan | None,
        wait: Wait,
        whole: Container[int] = (),
    ) -> None:
        """Split, shard or replicate this rank's stages (before any optimizer is built over their parameters).

        ``whole``: ids of parameters left alone on every axis (tied ones: :mod:`..frontends.tied` reduces them itself).
        """
        c = self.config
        self._wait = wait
        marks = parameter_marks(root)
        if c.tp > 1:
            self.require_plan(tp_plan)
            assert tp_plan is not None
            self.tp_split = apply_plan(root, self.mesh.sub("tp"), tp_plan)
            if c.sharding == 1:  # (FSDP aligns the gradients of the layers it shards itself)
                self._split_params = {s: [p for m in ls for p in m.parameters()] for s, ls in stages.items()}
        if c.sharding > 1:
            shard_mesh = self.mesh.sub("dp", "sharding") if c.dp > 1 else self.mesh.sub("sharding")
            self._units = {s: zero.shard_layers(layers, shard_mesh, whole) for s, layers in stages.items()}
        elif c.dp > 1:
            params: dict[int, Sequence[nn.Parameter]] = {
                s: [p for m in layers for p in m.parameters() if p.requires_grad and id(p) not in whole]
                for s, layers in stages.items()
            }
            self._averager = GradAverager(params, self.mesh.group("dp"), wait=wait)
        keep_marks(root, marks)

    def bound_groups(self, timeout: float) -> None:
        """Every axis group gives up on a collective after ``timeout`` seconds (see :func:`..comm.groups.bound`):
        FSDP2 and DTensor wait for theirs inside torch, where only the group's timeout stops a wait."""
        for axis in AXES:
            if self.config.size(axis) > 1:
                groups.bound(self.mesh.group(axis), timeout)

    def reduced_bytes(self) -> dict[int, int]:
        """Per local stage, the bytes of gradients its SYNC all-reduces over the data-parallel replicas (none
        without them, or when sharded): what the link fit prices the reduction's messages by."""
        if self._averager is None:
            return {}
        return {s: sum(p.numel() * p.element_size() for p in ps) for s, ps in self._averager.stage_params.items()}

    def drop_groups(self) -> None:
        """At exit: forget the data-parallel group (the mesh itself names its groups, it does not hold them)."""
        self._averager = None

    # ---- the step --------------------------------------------------------
    def on_sync(self, run: Run, stage: int) -> None:
        """SYNC: the stage's gradients are final: start their reduction over the replicas (inside a gradient
        merge they only accumulate, unreduced, FSDP2's unsharded: the merge's last step reduces their sum)."""
        if run.accumulate:
            return
        for p in self._split_params.get(stage, ()):
            align_grad(p)
        if self._averager is not None:
            self._averager.start(stage)
        if stage in self._units:
            zero.reduce(self._units[stage])

    def before_step(self, run: Run, stage: int) -> None:
        """STEP: the stage's reductions must be done first."""
        self.wait_reductions(stage)

    def wait_reductions(self, stage: int | None = None) -> None:
        """Wait for the reductions of ``stage`` (every stage if None)."""
        if self._averager is not None:
            self._averager.finish(stage)

    def after_train(self, losses: list[float], samples: float | None, *, exact: bool = False) -> list[float]:
        """Every reduction done; each mini-batch's loss averaged over the replicas.

        ``samples``: the rows this replica trained on (where the last stage is; None elsewhere). Replicas
        average their gradients with equal weights, so, unless the losses were weighted over every replica
        already (``exact``: ``loss_weights=``), they must have trained on equally many rows.
        """
        self.wait_reductions()
        n = 0.0 if samples is None else float(samples)
        total = torch.tensor([*losses, n, n * n], dtype=torch.float64, device=self.mesh.device_type)
        self.mesh.all_reduce(total, ("dp", "sharding"), wait=self._wait, what="the step's loss")
        *loss_sums, n_sum, sq_sum = total.tolist()
        r = self.config.replicas
        if not exact and n_sum > 0 and abs(r * sq_sum - n_sum * n_sum) > 0.5:  # equal iff r sum(n^2) == sum(n)^2
            raise ValueError(
                f"the {r} data-parallel replicas trained on batches of different sizes (mean {n_sum / r:g}); "
                "their gradients were averaged with equal weights: give every replica the same batch size "
                "(Pipeline.local_batch cuts a global batch evenly)"
            )
        return [s / r for s in loss_sums]

    def after_eval(self) -> None:
        for units in self._units.values():
            zero.reshard(units)

    # ---- global operations ----------------------------------------------
    def copies(self, t: torch.Tensor) -> int:
        """How many ranks of a pipeline stage's ``dp x sharding x tp`` block hold the same piece as ``t``."""
        c = self.config
        return c.dp * c.sharding * c.tp // pieces(t)

    def reduce(self, t: torch.Tensor, op: str, axes: tuple[str, ...] = AXES) -> None:
        """Reduce over ``axes`` (default every one: all ranks of the mesh), within the pipeline's deadline once
        attached."""
        self.mesh.all_reduce(t, axes, op, wait=self._wait, what="a reduction over the mesh")

    def local_batch(self, value: Any, dims: Dims, what: str, uneven: bool = False) -> Any:
        """This replica's equal share of a global batch (``value`` cut along ``dims``); ``uneven``: its
        ``tensor_split`` share, for an evaluation."""
        r = self.config.replicas
        if value is None or r == 1:
            return value
        parts, sizes = split(value, r, dims, what)
        if len(set(sizes)) > 1 and not uneven:
            raise ValueError(
                f"the {what} hold a batch of {sum(sizes)}, which does not split evenly over "
                f"dp={self.config.dp} x sharding={self.config.sharding} = {r} replicas (a train step needs equal "
                "shares; for an evaluation, pipe.local_batch(..., uneven=True) gives shares eval_loss weighs)"
            )
        return parts[self.mesh.replica]


def parameter_marks(root: nn.Module) -> dict[str, dict[str, Any]]:
    """By name, the attributes a user set on ``root``'s parameters (``p.no_decay = True``, read by an ``optimizer=``
    factory that builds its groups from them)."""
    return {n: dict(vars(p)) for n, p in root.named_parameters() if vars(p)}


def keep_marks(root: nn.Module, marks: dict[str, dict[str, Any]]) -> None:
    """Those attributes on the parameters that replaced them: ``tp_plan=`` and ``sharding`` make new (DTensor)
    parameters without them, and a factory reading the marks then built other groups than in one process, with
    no word (weight decay on every bias and norm). An attribute the new one has already is left as it is."""
    for name, p in root.named_parameters():
        for key, value in marks.get(name, {}).items():
            if key not in vars(p):
                setattr(p, key, value)
