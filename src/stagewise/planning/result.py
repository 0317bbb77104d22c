"""What the planner returns: ranked :class:`Plan` values, and the search that produced them."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..ir import Schedule
from ..parallel import ParallelConfig
from ..simulation import CostModel


@dataclass(frozen=True)
class RankMemory:
    """Predicted peak bytes on one pipeline rank (every replica and tp rank of it alike).

    ``parameters + gradients + optimizer`` is held all step (divided by
    ``sharding`` when the layout shards); ``activations`` is the simulator's
    peak of what the schedule keeps between forwards and backwards.
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    cap: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def dominant(self) -> str:
        """Which term is largest: 'parameters', 'gradients', 'optimizer state' or 'activations'."""
        terms = {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer state": self.optimizer,
            "activations": self.activations,
        }
        return max(terms, key=lambda k: terms[k])

    def to_dict(self) -> dict[str, float]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "cap": self.cap,
        }


@dataclass(frozen=True)
class Plan:
    """One way to run the model: layout, schedule, micro-batches, partition, recompute, and what it should cost.

    ``partition`` holds layer counts per stage (``pp * virtual_stages`` of
    them, in stage order, as ``Pipeline(partition=...)`` takes them).
    ``step_time`` is the predicted step time (below); ``bubble`` the
    simulated idle fraction of the pipeline ranks' compute; ``memory`` one
    :class:`RankMemory` per pipeline rank. ``breakdown`` splits the step:
    ``compute`` (the busiest rank's compute), ``grad_sync`` (gradient
    collectives left exposed after the drain, the tied layers' sum among them)
    and ``tp_comm`` (tensor-parallel all-reduces inside the busiest rank's
    compute). ``why`` says why it ranks above the next plan.

    **Predicted step time**: the seconds per ``Pipeline.train_step`` of a training loop in its steady state,
    steps run back to back on every rank: the slowest rank's time from the end of one step to the end of the
    next (equal on every rank, as each step ends with every rank holding its loss). It is the simulator's
    makespan of one step's actions - every micro-batch's forward and backward on every stage, the transfers
    between stages, the pipeline's idle time, tensor-parallel all-reduces, the gradient reductions at each
    stage's SYNC that the drain does not hide (data-parallel all-reduce, FSDP2's gathers and reduce-scatters,
    the gradient sum of layers tied across ranks: ``LayerProfile.tied``)
    - stretched where processes share cores, plus the runtime's measured costs per action and per step
    (splitting the batch, the step-end exchanges of loss and non-finite check; :class:`Calibration`). It
    leaves out: the optimizer step (``opt.step()``, or the STEP actions of ``Pipeline(optimizer=...)``), the
    data loader and moving the batch to the device, the first steps (shapes learned, buffers and connections
    made), checkpoints, meters (``measure_memory``), and anything the caller puts between steps - a barrier
    before each step adds the wait for the last rank to arrive and the skew of leaving it.
    ``benchmarks/plan_accuracy`` measures exactly this (and, beside it, the step from a barrier).
    """

    layout: ParallelConfig
    schedule: str
    virtual_stages: int
    microbatches: int
    microbatch_size: int
    partition: tuple[int, ...]
    recompute: str | None
    step_time: float
    bubble: float
    memory: tuple[RankMemory, ...]
    breakdown: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    why: str = ""
    #: the per-stage costs the prediction simulated (sync_time: the blocking collectives), to re-simulate or draw it
    costs: CostModel | None = field(default=None, compare=False, repr=False)
    #: the schedule itself when ``schedule == "auto"`` (synthesized for ``costs``; stagewise.planning.auto)
    synthesized: Schedule | None = field(default=None, compare=False, repr=False)

    @property
    def peak_memory(self) -> float:
        """The largest predicted peak over the ranks."""
        return max(m.total for m in self.memory)

    def describe(self) -> str:
        """One line: ``pp=4 dp=2 tp=1 sharding=1, 1f1b v=1, m=8, recompute off``."""
        return describe(self.layout, self.schedule, self.virtual_stages, self.microbatches, self.recompute)

    def pipeline_options(self) -> dict[str, object]:
        """The ``sw.Pipeline`` keywords that run this plan (see ``stagewise.runtime.frontends.plan``)."""
        return {
            "schedule": self.schedule if self.synthesized is None else self.synthesized,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "partition": list(self.partition),
            "recompute": self.recompute,
            "parallel": self.layout,
        }

    def digest(self) -> str:
        """A short hash of what the plan makes the runtime do (:meth:`pipeline_options`; a synthesized schedule's
        actions): ranks that hold plans with the same digest build the same pipeline. The predictions are left
        out, so plans that run alike match however they were predicted."""
        c = self.layout
        runs = {
            "layout": [c.pp, c.dp, c.tp, c.sharding],
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches,
            "partition": list(self.partition),
            "recompute": self.recompute,
            "synthesized": None if self.synthesized is None else self.synthesized.to_text(),
            "placement": None if self.synthesized is None else list(self.synthesized.placement),
        }
        return hashlib.sha256(json.dumps(runs, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, object]:
        c = self.layout
        return {
            "layout": {"pp": c.pp, "dp": c.dp, "tp": c.tp, "sharding": c.sharding},
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "partition": list(self.partition),
            "recompute": self.recompute,
            "step_time": self.step_time,
            "bubble": self.bubble,
            "peak_memory": self.peak_memory,
            "memory": [m.to_dict() for m in self.memory],
            "breakdown": dict(self.breakdown),
            "why": self.why,
            "digest": self.digest(),
            **({} if self.synthesized is None else {"synthesized": _schedule_dict(self.synthesized)}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan :meth:`to_dict` wrote (``stagewise plan --json``'s ``plans``): planned on one machine, built
        on another with ``Pipeline.from_plan``. Refused where its digest says it was edited (what runs would not
        be what was planned)."""
        synthesized = data.get("synthesized")
        plan = cls(
            layout=ParallelConfig(**data["layout"]),
            schedule=str(data["schedule"]),
            virtual_stages=int(data["virtual_stages"]),
            microbatches=int(data["microbatches"]),
            microbatch_size=int(data["microbatch_size"]),
            partition=tuple(int(k) for k in data["partition"]),
            recompute=data["recompute"],
            step_time=float(data["step_time"]),
            bubble=float(data["bubble"]),
            memory=tuple(RankMemory(**{k: float(m[k]) for k in _MEMORY}) for m in data["memory"]),
            breakdown=dict(data.get("breakdown", {})),
            why=str(data.get("why", "")),
            synthesized=None if synthesized is None else _schedule_of(synthesized),
        )
        if plan.schedule == "auto" and synthesized is None:
            raise ValueError(
                "Plan.from_dict: a plan of schedule 'auto' carries its synthesized schedule; this one does not"
            )
        if "digest" in data and plan.digest() != data["digest"]:
            raise ValueError(
                f"Plan.from_dict: the plan's digest is {plan.digest()}, but it was written with {data['digest']}: "
                "edited since (what runs would not be what was planned); plan again"
            )
        return plan


_MEMORY = ("parameters", "gradients", "optimizer", "activations", "cap")


def _schedule_dict(schedule: Schedule) -> dict[str, Any]:
    return {"name": schedule.name, "placement": list(schedule.placement), "csv": schedule.to_csv()}


def _schedule_of(data: dict[str, Any]) -> Schedule:
    return Schedule.from_csv(data["csv"], name=data["name"], placement=data["placement"])


def describe(layout: ParallelConfig, schedule: str, v: int, m: int, recompute: str | None) -> str:
    """How plans and dropped candidates are named: ``pp=4 dp=2 tp=1 sharding=1, 1f1b v=1, m=8, recompute off``."""
    c = layout
    return (
        f"pp={c.pp} dp={c.dp} tp={c.tp} sharding={c.sharding}, {schedule} v={v}, m={m}, recompute {recompute or 'off'}"
    )


@dataclass(frozen=True)
class Dropped:
    """A candidate the search rejected, and why (``what`` describes it as :meth:`Plan.describe` would)."""

    what: str
    reason: str


@dataclass(frozen=True)
class PlanSearch:
    """The ranked plans and what the search did.

    ``candidates``: the size of the space (every layout x schedule x v x
    recompute x micro-batch count); ``groups_expanded``: how many (layout,
    schedule, v, recompute) groups were partitioned and bounded (the rest were
    pruned whole by their bound); ``simulated``: candidates simulated;
    ``dropped``: candidates examined and rejected, with the reason.
    """

    plans: tuple[Plan, ...]
    candidates: int
    groups_expanded: int
    simulated: int
    dropped: tuple[Dropped, ...]
    layouts: int


def gib(x: float) -> str:
    """Bytes for people: ``1.5 GiB``, ``12 MiB``, ``300 B``."""
    if math.isinf(x):
        return "inf"
    return f"{x / 2**30:.3g} GiB" if x >= 2**30 else f"{x / 2**20:.3g} MiB" if x >= 2**20 else f"{x:.0f} B"
