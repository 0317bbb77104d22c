"""The planner: from a layer profile to ranked ways of running the model (DAPPLE's profiler -> planner -> runtime).

Pure (no torch). :func:`plan` searches layouts (pp x dp x sharding x tp),
schedules, virtual stages, micro-batch counts, partitions and recompute,
predicts each one's step time and per-rank peak memory with the simulator,
and returns the best as :class:`Plan` values; ``Pipeline.from_plan``
turns one into a pipeline. :mod:`.search` says how, :mod:`.costing` how
a step is costed (the equations), :mod:`.comm` how collectives are costed,
:class:`Calibration` what the runtime measured (``stagewise.calibrate()``).

(The package is ``stagewise.planning``; ``stagewise.plan`` is the function: this one on one process, the
same on every rank of a job.)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, TypedDict

from ..partition import LayerProfile
from .calibration import Calibration, LayoutCost
from .comm import Link, crosses_nodes, pipeline_nodes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .inputs import make_problem
from .result import Dropped, Plan, PlanSearch, RankMemory
from .search import run_search
from .synthetic import transformer_profile

if TYPE_CHECKING:  # (annotations only: Python 3.10's typing has neither)
    from typing_extensions import Required, Unpack

__all__ = [
    "Calibration",
    "LayoutCost",
    "Dropped",
    "Link",
    "Plan",
    "PlanOptions",
    "PlanSearch",
    "RankMemory",
    "plan",
    "crosses_nodes",
    "pipeline_nodes",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "search",
    "transformer_profile",
]


class PlanOptions(TypedDict, total=False):
    """The keywords of :func:`plan` and :func:`search` (defaults in brackets); see :func:`plan`."""

    global_batch: Required[int]
    memory: float | str | Sequence[float | str]  # [inf]: bytes, or a string with a unit ("8GiB")
    speeds: float | Sequence[float] | None  # [all 1]
    nodes: int  # [1]
    profile_batch: int  # [the profile's batch (LayerProfile.batch), else 1]
    optimizer_state: float  # [2.0]
    intra: Link | tuple[float, float] | None  # [the calibration's, else free]: a Link or (latency s, bytes/s)
    inter: Link | tuple[float, float] | None  # [the calibration's, else intra]
    tp_layers: Collection[int | str]  # [()]
    max_tp: int | None  # [processes per node]
    schedules: Sequence[str] | None  # [every synchronous one]; "auto" adds synthesized ones (see .auto)
    max_virtual_stages: int  # [4]
    recompute: Sequence[str | None]  # [(None, "stage")]
    overhead: float | Sequence[float]  # [0]
    action_overhead: float  # [0]
    compute_scale: float | Sequence[float]  # [1: the profile as measured]
    calibration: Calibration | None  # [None]
    cores: float | None  # [the calibration's, else None: a core per process]
    top: int  # [5]
    best_per_layout: bool  # [False]: the top plans; True: the top layouts, each with its best plan
    profiles: Sequence[LayerProfile]  # [()]: the same layers profiled at other micro-batch sizes


def search(profile: LayerProfile, processes: int, **options: Unpack[PlanOptions]) -> PlanSearch:
    """Like :func:`plan`, returning the whole search: plans, candidates, pruned, simulated, dropped with reasons."""
    unknown = sorted(set(options) - set(PlanOptions.__annotations__))
    if unknown:
        raise TypeError(f"plan: unknown option(s) {unknown}; known: {', '.join(PlanOptions.__annotations__)}")
    if "global_batch" not in options:
        raise TypeError("plan: global_batch= (samples per step) is required")
    names = options.get("schedules")
    auto = names is not None and not isinstance(names, str) and "auto" in names
    if auto:  # the registered ones are searched as usual (all of them when "auto" is alone); see .auto
        assert names is not None
        options["schedules"] = [n for n in names if n != "auto"] or None
    return run_search(make_problem(profile, processes, **options), synthesize=auto)


def plan(profile: LayerProfile, processes: int, **options: Unpack[PlanOptions]) -> list[Plan]:
    """The ``top`` fastest plans that fit memory, fastest first, each saying why it beat the next.

    Pure: it plans on this process alone, from its arguments (inside a job, :func:`stagewise.plan` gives
    every rank the plans of rank 0's inputs).

    ``profile``: per-layer times and bytes of one micro-batch of ``profile_batch`` samples
    (:func:`stagewise.profile`); costs scale linearly with the micro-batch size, unless ``profiles`` holds the
    same layers profiled at other sizes: then each layer's forward and backward are a line through every size
    (a fixed part, as ``overhead``, and a part that scales), so that small micro-batches are not priced at a
    linear share of a larger one's cost. Layers the profile records as tied (:attr:`LayerProfile.tied`: an
    embedding and the head reusing it, found by :func:`stagewise.profile`) have their gradients summed over the
    ranks holding them and their replicas at each step's end: every plan waits for that sum, a ring on the link
    between nodes where those ranks span nodes (none where one rank holds every use, as ZB-V's V does, but for
    its replicas).
    ``processes`` ranks on ``nodes`` nodes (packed in rank order), each with
    ``memory`` (bytes, or a string with a unit: ``"8GiB"``) and relative ``speeds`` (one number, or one per rank).
    ``global_batch``: samples per step, split over the ``dp * sharding`` replicas, then into
    micro-batches. ``optimizer_state``: optimizer bytes per parameter byte (AdamW: 2).
    ``intra`` / ``inter``: the links inside a node and between nodes, a :class:`Link` or ``(latency,
    bandwidth)`` (``inter`` defaults to ``intra``; both default to the ``calibration``'s measured links, else
    free: :func:`stagewise.plan` warns then).
    ``tp_layers``: indices or names of the layers that
    can be split by tensor parallelism (no tp without them); ``max_tp``
    defaults to the processes per node. ``overhead``: seconds of each layer's
    forward and of its backward that do not scale with the batch (one number, or one per layer);
    ``action_overhead``: the runtime's seconds per stage forward and per backward (added to the
    calibration's). ``compute_scale``: what the runtime's compute actions cost over what the profile predicts for
    them, one factor or (forward, backward[, I + W under schedules that split the backward]), as
    :func:`stagewise.measure_compute_scale` measures it on the group (each stage's forward and backward are
    multiplied by it, tp all-reduces aside). ``calibration``: what
    ``stagewise.calibrate()`` measured on the group (links, per-action and per-message costs, FSDP2's cost per
    layer). ``cores``: cores per node; when
    fewer than its processes, no step is shorter than the node's compute over its cores.

    ``schedules``: the registered schedules to search (every synchronous one by default); ``"auto"`` among
    them also re-plans each of the ``top`` plans with a schedule synthesized for its stage costs and left-over
    memory (:mod:`stagewise.synthesis`), kept as ``schedule="auto"`` where faster (:mod:`.auto`).

    Raises ``ValueError`` when no factorisation of ``processes`` can run, or
    when no plan fits ``memory`` (naming the smallest peak and its largest term).
    """
    return list(search(profile, processes, **options).plans)
