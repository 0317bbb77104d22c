"""The options of every way in: one frozen, validated value with one meaning per name.

``Pipeline(layers, ...)``, ``Pipeline.from_model``, ``from_hf``, ``from_stages``, ``from_plan`` and
``HetPipe`` all take these keywords (or an :class:`Options` built once and reused). A name means the same
thing everywhere; an option that cannot apply to a way in (``seed=`` for a model whose weights already
exist) is refused by name, with the reason, before any rank communicates (:func:`check_applicable`); a
misspelt one is refused naming the closest valid one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
from torch import nn

from .._util import is_count, is_finite_number
from ..ir import Schedule
from ..partition import PartitionSpec, needs_profile
from ..planning.units import parse_bytes
from ..schedules import canonical_name
from .comm.choose_transport import TransportChoice, check_choice
from .elastic.config import SnapshotSpec, snapshot_config
from .engine.microbatch import Dims
from .features.batchnorm import BatchNormPolicy, check_batchnorm
from .features.finite import check_policy
from .features.offload import check_offload
from .features.owned_step import SchedulerFactory, check_owned_step
from .features.precision import check_autocast
from .features.recompute import Recompute, check_recompute
from .losses import check_loss_fn
from .reporting.config import MetricsSpec, metrics_config, progress_every

if TYPE_CHECKING:
    from ..parallel import ParallelConfig
    from .hybrid.mesh import Mesh
    from .hybrid.tensor_parallel import TPPlan

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
LossWeights = Callable[[Any], Any]  # one micro-batch's targets -> how many items its mean loss is over


@dataclass(frozen=True)
class Options:
    """Every option of a pipeline, each documented here once (``tests/runtime/test_options.py`` checks that every
    field is, and that the keywords' TypedDict lists each with its type).

    Build one with keywords (``Options(schedule="zb-v", microbatches=8)``), or let a constructor build it
    from its keywords. ``given`` records which options were set explicitly (so that one that cannot apply
    to a way in is refused only when asked for).

    *What runs.* ``schedule``: a registered name or a :class:`~stagewise.Schedule` (its rank count must be
    the group size). ``microbatches`` defaults to the schedule's count, or the group size for a name;
    ``virtual_stages`` to the schedule's default; ``stages``: how many stages the model is cut into (with a
    name and no ``virtual_stages``, ``stages / ranks`` virtual stages per rank).

    *Where.* ``group``: the process group (default: the world); or ``parallel``: a
    :class:`~stagewise.ParallelConfig` (or built :class:`~stagewise.Mesh`) for pipeline x data x
    ZeRO-sharded x tensor parallelism: the schedule runs on the mesh's ``pp`` group, stages are replicated
    over ``dp`` and sharded over ``sharding`` (gradients reduced at each stage's SYNC), the layers ``tp_plan``
    names are split over ``tp``; each replica trains on its own slice (:meth:`local_batch`). ``device``,
    ``transport`` (``"auto"``, ``"shm"``, ``"torch"`` or a factory), ``timeout`` (seconds any wait may take
    before every rank raises :class:`~stagewise.PipelineError` naming where each stood), ``store``.

    *How it is cut.* ``partition``: ``"balanced"`` (the default: work counted on the meta device from
    ``sample_inputs``, else parameters, or for convolutions the first batch), ``"uniform"``, ``"parameters"``,
    ``"time"``, ``"memory"`` or layer counts per stage (``"time"`` / ``"memory"`` profile ``sample_inputs``,
    one micro-batch, on the first rank);
    ``speeds`` and ``memory_caps`` (bytes, or text such as ``"16GiB"``), one per rank, for heterogeneous
    ranks; ``seed``;
    ``free_unused`` and ``concrete_args`` (models built whole, :meth:`from_model`).

    *How it trains.* ``loss_fn(output, target)`` returns the micro-batch's *mean* loss; each micro-batch's
    loss is weighted by its share of the batch (of the rows, or of ``loss_weights(targets)``, e.g.
    :func:`~stagewise.count_tokens`: a token-level mean over the whole batch, over every data-parallel
    replica too). ``optimizer``: a factory ``params -> Optimizer``, one per stage, stepped by the
    schedule's STEP actions (asynchronous schedules need one); with it ``lr_scheduler`` and ``clip=max_norm``
    (:mod:`stagewise.runtime.features.owned_step`). ``batch_dim`` / ``target_batch_dim``. ``recompute``,
    ``autocast`` (``torch.bfloat16`` / ``float16``), ``batchnorm`` (``"micro"`` or ``"deferred"``: running
    statistics per micro-batch or once per step over the whole batch),
    ``nan_policy`` (``"raise"``, ``"skip"`` or None: a non-finite loss or gradient anywhere in the mesh),
    ``dropout_seed`` (each dropout mask is drawn from a generator seeded by this, or ``seed``, with the step,
    micro-batch and module: alike under every layout and schedule, :mod:`stagewise.runtime.features.dropout`),
    ``measure_memory``, ``variable_shapes``, ``emulate_slowdown`` (an EMULATION of slower devices),
    ``offload="optimizer"`` (the optimizer's state, and float32 master weights, in host memory; the update runs
    on the host: :mod:`stagewise.runtime.features.offload`). ``schedule="auto"`` synthesizes the schedule for
    the layers' measured costs (a layer list with ``sample_inputs``: :mod:`stagewise.runtime.assembly.auto_schedule`).
    ``snapshot=k`` (or a :class:`~stagewise.Snapshots`): each rank's state after every k-th step, in memory on
    its machine and a peer's, which ``sw.checkpoint.resume`` weighs against the disk (:mod:`stagewise.runtime.elastic`).
    ``metrics="DIR"`` (a :class:`~stagewise.runtime.MetricsConfig`): each step's numbers to JSON lines and
    TensorBoard; ``progress`` (True, every N steps, False): rank 0's line (:mod:`stagewise.runtime.reporting`).
    """

    # what runs
    schedule: str | Schedule = "1f1b"
    microbatches: int | None = None
    virtual_stages: int | None = None
    stages: int | None = None
    # where it runs
    group: Any = None
    parallel: ParallelConfig | Mesh | None = None
    tp_plan: TPPlan | None = None
    device: torch.device | str | None = None
    transport: TransportChoice = None
    timeout: float = 300.0
    store: Any = None
    # how the model is cut and built
    partition: PartitionSpec = "balanced"
    sample_inputs: Any = None
    speeds: Sequence[float] | None = None
    memory_caps: Sequence[float | str] | None = None
    seed: int = 0
    dropout_seed: int | None = None
    free_unused: bool = True
    concrete_args: dict[str, Any] | None = None
    # how it trains
    loss_fn: LossFn | None = None
    loss_weights: LossWeights | None = None
    optimizer: OptimizerFactory | None = None
    lr_scheduler: SchedulerFactory | None = None
    clip: float | None = None
    offload: str | None = None
    batch_dim: Dims = 0
    target_batch_dim: Dims = 0
    recompute: Recompute = None
    autocast: torch.dtype | None = None
    batchnorm: str | BatchNormPolicy | None = None
    nan_policy: str | None = "raise"
    measure_memory: bool = False
    variable_shapes: bool = False
    emulate_slowdown: float | Sequence[float] | None = None
    snapshot: SnapshotSpec = None
    metrics: MetricsSpec = None
    progress: bool | int = True
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_caps", _caps_in_bytes(self.memory_caps))
        _check_what_runs(self)
        _check_cut(self)
        check_policy(self.nan_policy)
        check_batchnorm(self.batchnorm)
        check_loss_fn(self.loss_fn)
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(f"optimizer must be a factory params -> torch.optim.Optimizer, got {self.optimizer!r}")
        if self.loss_weights is not None and not callable(self.loss_weights):
            raise TypeError(f"loss_weights must be a function of a micro-batch's targets, got {self.loss_weights!r}")
        check_owned_step(self.optimizer, self.lr_scheduler, self.clip)
        check_offload(self.offload)
        if self.offload is not None and self.optimizer is None:
            raise ValueError(
                f"offload={self.offload!r} moves the optimizer's state to the host: it needs optimizer=, a factory "
                "params -> Optimizer (the optimizer each stage steps at its STEP actions)"
            )
        check_recompute(self.recompute)
        check_autocast(self.autocast)
        check_choice(self.transport)
        _check_slowdown(self.emulate_slowdown)
        snapshot_config(self.snapshot)
        metrics_config(self.metrics)
        progress_every(self.progress)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        if self.group is not None and self.parallel is not None:
            raise ValueError("pass either group= or parallel=: with parallel= the pipeline runs on the mesh's pp group")

    @classmethod
    def of(cls, entry: str, options: Options | None = None, keywords: Mapping[str, Any] | None = None) -> Options:
        """``options`` (or the defaults) with ``keywords`` set on top; an unknown keyword is refused, naming the
        closest valid one and ``entry`` (how the user called: ``"Pipeline.from_hf"``)."""
        keywords = dict(keywords or {})
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"{entry}: options must be a stagewise.Options, got {type(options).__name__}")
        unknown = sorted(set(keywords) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{entry}: {_unknown(unknown)}")
        base = options if options is not None else cls()
        return replace(base, **keywords, given=base.given | frozenset(keywords))

    @property
    def caps(self) -> Sequence[float] | None:
        """``memory_caps`` in bytes (text such as ``"16GiB"`` was read when the options were made)."""
        return cast("Sequence[float] | None", self.memory_caps)

    def is_given(self, name: str) -> bool:
        return name in self.given

    def with_defaults(self, **defaults: Any) -> Options:
        """These options with ``defaults`` filled in where the user gave none (a way in's own defaults)."""
        unset = {k: v for k, v in defaults.items() if k not in self.given}
        return replace(self, **unset) if unset else self

    @property
    def optimizer_steps(self) -> bool:
        """Whether the schedule gets a STEP action per stage: with an optimizer factory (each stage steps its own)."""
        return self.optimizer is not None

    @property
    def steps_at_end(self) -> bool:
        """Where the STEP actions go: at the end of each rank's list when the step-end check of non-finite values
        must come first (its collective runs at the first STEP), or the whole model's gradient is clipped there
        (``clip=``); else right after each stage's SYNC, overlapping the drain."""
        return self.nan_policy is not None or self.clip is not None

    def slowdown_of(self, rank: int, num_ranks: int) -> float:
        """EMULATION of a slower device: the factor group rank ``rank`` stretches each compute action by."""
        f = self.emulate_slowdown
        if f is None:
            return 1.0
        if isinstance(f, (int, float)):
            return float(f)
        if len(f) != num_ranks:
            raise ValueError(f"emulate_slowdown needs one factor per rank of the group ({num_ranks}), got {len(f)}")
        return float(f[rank])


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options) if f.name != "given")


class PipelineOptions(TypedDict, total=False):
    """The keywords every way in takes (the fields of :class:`Options`), for type checkers and editors."""

    schedule: str | Schedule
    microbatches: int | None
    virtual_stages: int | None
    stages: int | None
    group: Any
    parallel: ParallelConfig | Mesh | None
    tp_plan: TPPlan | None
    device: torch.device | str | None
    transport: TransportChoice
    timeout: float
    store: Any
    partition: PartitionSpec
    sample_inputs: Any
    speeds: Sequence[float] | None
    memory_caps: Sequence[float | str] | None
    seed: int
    dropout_seed: int | None
    free_unused: bool
    concrete_args: dict[str, Any] | None
    loss_fn: LossFn | None
    loss_weights: LossWeights | None
    optimizer: OptimizerFactory | None
    lr_scheduler: SchedulerFactory | None
    clip: float | None
    offload: str | None
    batch_dim: Dims
    target_batch_dim: Dims
    recompute: Recompute
    autocast: torch.dtype | None
    batchnorm: str | BatchNormPolicy | None
    nan_policy: str | None
    measure_memory: bool
    variable_shapes: bool
    emulate_slowdown: float | Sequence[float] | None
    snapshot: SnapshotSpec
    metrics: MetricsSpec
    progress: bool | int


def check_applicable(entry: str, refused: Mapping[str, str], options: Options) -> None:
    """Refuse every option the user gave that ``entry`` cannot apply (``refused``: option -> why not)."""
    bad = [name for name in OPTION_NAMES if name in refused and options.is_given(name)]
    if bad:
        raise ValueError("; ".join(f"{entry} does not take {name}=: {refused[name]}" for name in bad))


def _unknown(names: list[str]) -> str:
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return f"unknown option {', '.join(parts)} (stagewise.Options lists every option)"


def _check_what_runs(o: Options) -> None:
    if not isinstance(o.schedule, (str, Schedule)):
        raise TypeError(f"schedule must be a registered name or a stagewise.Schedule, got {type(o.schedule).__name__}")
    if isinstance(o.schedule, str):  # "1F1B", "interleaved": the registered name (a did-you-mean if none)
        name = "auto" if o.schedule.strip().lower() == "auto" else canonical_name(o.schedule)
        object.__setattr__(o, "schedule", name)
    for name in ("microbatches", "virtual_stages", "stages"):
        value = getattr(o, name)
        if value is not None and not is_count(value):
            raise ValueError(f"{name} must be an integer >= 1 (or None), got {value!r}")


def _check_cut(o: Options) -> None:
    if isinstance(o.seed, bool) or not isinstance(o.seed, int):
        raise TypeError(f"seed must be an int, got {o.seed!r}")
    if o.dropout_seed is not None and (isinstance(o.dropout_seed, bool) or not isinstance(o.dropout_seed, int)):
        raise TypeError(f"dropout_seed must be an int or None (the seed), got {o.dropout_seed!r}")
    if isinstance(o.partition, Sequence) and not isinstance(o.partition, str) and o.partition:
        bad = [(s, k) for s, k in enumerate(o.partition) if not is_count(k)]
        if bad and all(isinstance(k, int) and not isinstance(k, bool) for _, k in bad):
            raise ValueError(
                f"partition={list(o.partition)!r}: every stage needs at least one layer, but stage {bad[0][0]} has "
                f"{bad[0][1]} (counts are layers per stage, in order)"
            )
    if not isinstance(o.partition, str) and not (
        isinstance(o.partition, Sequence) and all(is_count(k) for k in o.partition)
    ):
        raise ValueError(
            "partition must be 'balanced', 'uniform', 'parameters', 'time', 'memory' or a list of layer counts, "
            f"got {o.partition!r}"
        )
    needs_profile(o.partition)  # an unknown mode name is refused here
    for name in ("speeds", "memory_caps"):
        values = getattr(o, name)
        if values is None:
            continue
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a sequence of numbers, one per rank, got {values!r}")
        if not all(is_finite_number(v) and v > 0 for v in values):
            raise ValueError(f"{name} must be finite numbers > 0, one per rank, got {list(values)}")


def _caps_in_bytes(caps: Sequence[float | str] | None) -> Sequence[float | str] | None:
    """``memory_caps`` with sizes written as text (``"16GiB"``) in bytes; anything else is left for the checks."""
    if caps is None or isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
        return caps
    if not any(isinstance(v, str) for v in caps):
        return caps
    return [parse_bytes(v, f"memory_caps[{i}]", bare=False) if isinstance(v, str) else v for i, v in enumerate(caps)]


def _check_slowdown(f: float | Sequence[float] | None) -> None:
    """``emulate_slowdown``: factors >= 1 (sleeping can make a rank slower, never faster)."""
    if f is None:
        return
    values = [f] if isinstance(f, (int, float)) else list(f)
    for v in values:
        if not is_finite_number(v, 1.0):
            raise ValueError(f"emulate_slowdown factors must be numbers >= 1 (1: full speed), got {f!r}")
