"""The planner's inputs, checked once (each error names the option), per-rank values expanded."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .._util import is_count
from ..partition import LayerProfile
from ..schedules import canonical_name, is_asynchronous, schedule_names
from .calibration import Calibration
from .comm import Link
from .costing import batch_lines
from .units import parse_bytes


@dataclass(frozen=True)
class Problem:
    """The inputs, checked and expanded per rank."""

    profile: LayerProfile
    processes: int
    per_node: int
    memory: tuple[float, ...]
    speeds: tuple[float, ...]
    global_batch: int
    profile_batch: int
    optimizer_state: float
    intra: Link
    inter: Link
    tp_layers: frozenset[int]
    max_tp: int
    schedules: tuple[str, ...]
    max_virtual_stages: int
    recompute: tuple[str | None, ...]
    overhead: tuple[float, ...]  # per layer
    action_overhead: float  # per stage action (F, and B = I + W): the argument plus the calibration's
    message: float  # per point-to-point message, charged to the action that posts or receives it
    compute_scale: tuple[float, float, float]  # the runtime's measured compute over the plan's: F, B, split I + W
    calibration: Calibration
    cores: float | None  # per node; None: a core (or device) per process
    top: int
    best_per_layout: bool = False  # the top layouts, each with its best plan, rather than the top plans
    backward_overhead: tuple[float, ...] = ()  # per layer, where a backward's fixed part is not overhead's


def make_problem(
    profile: LayerProfile,
    processes: int,
    *,
    global_batch: int,
    memory: float | str | Sequence[float | str] = math.inf,
    speeds: float | Sequence[float] | None = None,
    nodes: int = 1,
    profile_batch: int | None = None,
    optimizer_state: float = 2.0,
    intra: Link | tuple[float, float] | None = None,
    inter: Link | tuple[float, float] | None = None,
    tp_layers: Collection[int | str] = (),
    max_tp: int | None = None,
    schedules: Sequence[str] | None = None,
    max_virtual_stages: int = 4,
    recompute: Sequence[str | None] = (None, "stage"),
    overhead: float | Sequence[float] = 0.0,
    action_overhead: float = 0.0,
    compute_scale: float | Sequence[float] = 1.0,
    calibration: Calibration | None = None,
    cores: float | None = None,
    top: int = 5,
    best_per_layout: bool = False,
    profiles: Sequence[LayerProfile] = (),
) -> Problem:
    """Check every input, naming the option and the value expected (``profiles``: :func:`_lined`)."""
    profile, batch, fixed, fixed_b = _lined(profile, profiles, profile_batch, overhead, action_overhead)
    _check_counts(profile, processes, nodes, global_batch, batch, optimizer_state)
    _check_search_limits(top, max_virtual_stages, recompute)
    mem, spd = _memory_and_speeds(memory, speeds, processes)
    tp_idx, chosen = _tp_indices(tp_layers, profile.names), _chosen_schedules(schedules)
    cal, cores = _calibration_and_cores(calibration, cores)
    (intra, inter), per_node = _links(as_link(intra, "intra"), as_link(inter, "inter"), cal), processes // nodes
    return Problem(
        profile=profile,
        processes=processes,
        per_node=per_node,
        memory=tuple(mem),
        speeds=tuple(spd),
        global_batch=global_batch,
        profile_batch=batch,
        optimizer_state=float(optimizer_state),
        intra=intra,
        inter=inter,
        tp_layers=frozenset(tp_idx),
        max_tp=per_node if max_tp is None else max_tp,
        schedules=tuple(chosen),
        max_virtual_stages=max_virtual_stages,
        recompute=tuple(recompute) or (None,),
        overhead=tuple(fixed),
        action_overhead=float(action_overhead) + cal.action,
        message=cal.message,
        compute_scale=_compute_scale(compute_scale),
        calibration=cal,
        cores=cores,
        top=top,
        best_per_layout=bool(best_per_layout),
        backward_overhead=fixed_b,
    )


def _profile_batch(profile: LayerProfile, given: int | None) -> int:
    """The samples the profile's costs are for: the profile's own record, which ``profile_batch`` may only repeat
    (a different number would scale every predicted time by the wrong factor); 1 for a profile without one."""
    recorded = getattr(profile, "batch", None)
    if given is None:
        return 1 if recorded is None else recorded
    if recorded is not None and given != recorded:
        raise ValueError(
            f"plan: profile_batch={given!r}, but the profile was measured on micro-batches of {recorded} samples "
            f"(LayerProfile.batch); leave profile_batch out"
        )
    return given


def _check_counts(
    profile: LayerProfile, processes: int, nodes: int, global_batch: int, profile_batch: int, optimizer_state: float
) -> None:
    if not isinstance(profile, LayerProfile) or len(profile) == 0:
        raise ValueError(f"plan: profile must be a non-empty LayerProfile, got {type(profile).__name__}")
    if not is_count(processes):
        raise ValueError(f"plan: processes must be a positive int, got {processes!r}")
    if not is_count(nodes) or processes % nodes:
        raise ValueError(f"plan: nodes must be a positive int dividing processes ({processes}), got {nodes!r}")
    if not is_count(global_batch):
        raise ValueError(f"plan: global_batch must be a positive int (samples per step), got {global_batch!r}")
    if not isinstance(profile_batch, int) or profile_batch < 1:
        raise ValueError(
            f"plan: profile_batch must be a positive int (samples in the profiled micro-batch), got {profile_batch!r}"
        )
    if not 0 <= optimizer_state < math.inf:
        raise ValueError(
            f"plan: optimizer_state must be >= 0 (state bytes per parameter byte), got {optimizer_state!r}"
        )


def _lined(
    profile: LayerProfile, profiles: Sequence[LayerProfile], profile_batch: int | None,
    overhead: float | Sequence[float], action_overhead: float,
) -> tuple[LayerProfile, int, list[float], tuple[float, ...]]:  # fmt: skip
    """The profile the planner scales, its batch, the fixed seconds per layer of each forward and (where they
    differ) of each backward: ``profile`` and ``overhead`` as given, or with ``profiles`` (the same layers at
    other micro-batch sizes) each layer's line through every size (:func:`~stagewise.planning.costing.batch_lines`),
    its fixed parts added to ``overhead``."""
    if not isinstance(profile, LayerProfile) or len(profile) == 0:
        raise ValueError(f"plan: profile must be a non-empty LayerProfile, got {type(profile).__name__}")
    fixed = _overheads(overhead, action_overhead, len(profile))
    if not profiles:
        return profile, _profile_batch(profile, profile_batch), fixed, ()
    lines = batch_lines([profile, *profiles])
    return (lines.profile, _profile_batch(lines.profile, profile_batch), [x + y for x, y in zip(fixed, lines.forward)],
            tuple(x + y for x, y in zip(fixed, lines.backward)))  # fmt: skip


def _overheads(overhead: float | Sequence[float], action_overhead: float, layers: int) -> list[float]:
    """``overhead`` per layer (seconds), ``action_overhead`` checked too."""
    fixed = [float(overhead)] * layers if isinstance(overhead, (int, float)) else [float(x) for x in overhead]
    if not 0 <= action_overhead < math.inf:
        raise ValueError(f"plan: action_overhead must be seconds >= 0, got {action_overhead!r}")
    if len(fixed) != layers or not all(0 <= x < math.inf for x in fixed):
        raise ValueError(f"plan: overhead must be seconds >= 0, one number or one per layer ({layers})")
    return fixed


def _check_search_limits(top: int, max_virtual_stages: int, recompute: Sequence[str | None]) -> None:
    if top < 1:
        raise ValueError(f"plan: top must be >= 1, got {top}")
    if max_virtual_stages < 1:
        raise ValueError(f"plan: max_virtual_stages must be >= 1, got {max_virtual_stages}")
    _check_recompute(recompute)


def _check_recompute(recompute: Sequence[str | None]) -> None:
    for rc in recompute:
        if rc not in (None, "stage"):
            raise ValueError(f"plan: recompute choices must be None or 'stage', got {rc!r}")


def _memory_and_speeds(
    memory: float | str | Sequence[float | str], speeds: float | Sequence[float] | None, processes: int
) -> tuple[list[float], list[float]]:
    mem = _per_rank_values(memory, processes, "memory")
    if any(not x > 0 for x in mem):
        raise ValueError(f"plan: memory must be > 0 bytes per rank, got {min(mem)}")
    spd = _per_rank_values(1.0 if speeds is None else speeds, processes, "speeds")
    if any(not 0 < x < math.inf for x in spd):
        raise ValueError(f"plan: speeds must be finite and > 0, got {min(spd)}")
    return mem, spd


def _tp_indices(tp_layers: Collection[int | str], names: list[str]) -> set[int]:
    """The indices of the layers ``tp_layers`` names (by index or by name)."""
    tp_idx = set()
    for key in tp_layers:
        if isinstance(key, str):
            if key not in names:
                raise ValueError(f"plan: tp_layers names {key!r}, not a layer of the profile ({names[:8]}...)")
            tp_idx.add(names.index(key))
        elif isinstance(key, int) and 0 <= key < len(names):
            tp_idx.add(key)
        else:
            raise ValueError(f"plan: tp_layers entry {key!r} is not a layer index 0..{len(names) - 1} or name")
    return tp_idx


def _chosen_schedules(schedules: Sequence[str] | None) -> list[str]:
    """The schedules to search: registered and synchronous (all of those by default)."""
    known = schedule_names()
    try:  # any case, or an alias ("interleaved"): the registered name
        chosen = [n for n in known if not is_asynchronous(n)] if schedules is None else _names(schedules)
    except ValueError as err:
        raise ValueError(f"plan: {err}") from None
    for name in chosen:
        if is_asynchronous(name):
            raise ValueError(f"plan: schedule {name!r} is asynchronous; the planner times synchronous steps only")
    if not chosen:
        raise ValueError("plan: schedules is empty")
    return chosen


def _names(schedules: Sequence[str]) -> list[str]:
    if isinstance(schedules, str):
        raise ValueError(f"schedules must be a list of names, got the string {schedules!r}")
    return [canonical_name(n) for n in schedules]


def _calibration_and_cores(calibration: Calibration | None, cores: float | None) -> tuple[Calibration, float | None]:
    """The calibration (a default one if none), and the cores per node (the calibration's if not given)."""
    cal = Calibration() if calibration is None else calibration
    if not isinstance(cal, Calibration):
        raise ValueError(f"plan: calibration must be a Calibration (stagewise.calibrate()), got {type(cal).__name__}")
    cores = cal.cores if cores is None else cores
    if cores is not None and (
        isinstance(cores, bool) or not isinstance(cores, (int, float)) or not 0 < cores < math.inf
    ):
        raise ValueError(f"plan: cores must be a number > 0 (cores per node) or None, got {cores!r}")
    return cal, cores


def as_link(value: Link | tuple[float, float] | None, what: str) -> Link | None:
    """A :class:`Link`, or ``(latency seconds, bandwidth bytes/s)`` as one."""
    if value is None or isinstance(value, Link):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        latency, bandwidth = float(value[0]), float(value[1])
        if latency > 1.0 and bandwidth < 1e3:  # (a second's latency, under a kB/s: the pair reads swapped)
            raise ValueError(
                f"plan: {what}={tuple(value)!r} reads as {latency:g} s of latency and {bandwidth:g} bytes/s: the "
                f"pair is (latency seconds, bandwidth bytes per second), e.g. {what}=(5e-6, 2.5e10); swapped?"
            )
        return Link(latency, bandwidth)
    raise TypeError(f"plan: {what} must be a Link or (latency seconds, bandwidth bytes per second), got {value!r}")


def _links(intra: Link | None, inter: Link | None, cal: Calibration) -> tuple[Link, Link]:
    """The links within and across nodes: as given, else the calibration's; across defaults to within."""
    intra = intra if intra is not None else cal.intra if cal.intra is not None else Link()
    inter = inter if inter is not None else cal.inter
    return intra, intra if inter is None else inter


def _compute_scale(value: float | Sequence[float]) -> tuple[float, float, float]:
    """``compute_scale`` as (forward, backward, split backward) factors, each finite and > 0: one number for all
    three, (forward, backward) for a split backward like the fused one, or all three."""
    if isinstance(value, (int, float)):
        values = [value] * 3
    else:
        try:
            values = list(value)
        except TypeError:
            values = []
        if len(values) == 2:
            values.append(values[1])
    if (
        isinstance(value, bool)
        or len(values) != 3
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in values)
    ):
        raise ValueError(
            f"plan: compute_scale must be a number > 0, or (forward, backward[, split backward]) numbers > 0 "
            f"(stagewise.measure_compute_scale()), got {value!r}"
        )
    return float(values[0]), float(values[1]), float(values[2])


def _per_rank_values(value: float | str | Sequence[float | str], n: int, what: str) -> list[float]:
    if isinstance(value, (int, float, str)):  # memory: bytes, or a string with a unit ("8GiB")
        return [parse_bytes(value, what)] * n
    values = [parse_bytes(x, what) for x in value]
    if len(values) != n:
        raise ValueError(f"plan: {what} has {len(values)} entries, expected one per process ({n})")
    return values
