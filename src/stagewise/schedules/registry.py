"""The schedule registry: names -> pure generators of per-rank compute orders."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._util import gc_paused
from ..ir import Action, ActionRows, Schedule, loop_placement, v_placement

#: A generator takes (ranks p, micro-batches m, virtual stages v) and returns,
#: for each rank, its compute actions (F, B or F, I, W) in order: lists of actions, or an
#: :class:`~stagewise.ir.columns.ActionRows` made from integer columns (kept as it is, not copied).
Generator = Callable[[int, int, int], Sequence[Sequence[Action]]]


@dataclass(frozen=True)
class ScheduleInfo:
    """What the registry knows about a schedule, besides how to generate it."""

    name: str
    generator: Generator
    summary: str
    paper: str
    placement: str  # "loop" or "v"
    virtual_stages: tuple[int, ...] | None  # allowed v, None = any v >= 1
    default_virtual_stages: int
    bubble: str  # closed form with uniform costs and free transfers, for the README table
    memory: str  # peak in-flight micro-batches on the busiest rank
    #: what a transfer time c adds to the makespan with uniform costs (F = I = W), where a closed form is known
    transfer: str = "no closed form"
    #: False for schedules that apply updates while other micro-batches are in flight (no flush): they
    #: train by a different rule than one process, and planners and train_step leave them out
    synchronous: bool = True
    #: (p, m, v) -> the whole compute-only Schedule, meta included (asynchronous schedules carry a version
    #: table); None = a Schedule around ``generator``'s action lists
    build: Callable[[int, int, int], Schedule] | None = None

    def check(self, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
        """Raise ValueError naming the constraint a combination breaks.

        Every registered schedule builds and validates for any p >= 1 and m >= 1
        with an allowed v (the tests check a grid including m < p, m = 1, p = 1).
        """
        if num_ranks < 1:
            raise ValueError(f"schedule {self.name!r}: need at least 1 rank, got {num_ranks}")
        if num_microbatches < 1:
            raise ValueError(f"schedule {self.name!r}: need at least 1 micro-batch, got {num_microbatches}")
        if self.virtual_stages is not None and virtual_stages not in self.virtual_stages:
            allowed = " or ".join(map(str, self.virtual_stages))
            raise ValueError(f"schedule {self.name!r} needs virtual_stages = {allowed} per rank, got {virtual_stages}")
        if virtual_stages < 1:
            raise ValueError(f"schedule {self.name!r}: virtual_stages must be >= 1, got {virtual_stages}")


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(
    name: str,
    *,
    summary: str,
    paper: str,
    bubble: str,
    memory: str,
    transfer: str = "no closed form",
    placement: str = "loop",
    virtual_stages: tuple[int, ...] | None = (1,),
    default_virtual_stages: int = 1,
    synchronous: bool = True,
    build: Callable[[int, int, int], Schedule] | None = None,
) -> Callable[[Generator], Generator]:
    """Decorator: add a generator to the registry under ``name``."""

    def add(generator: Generator) -> Generator:
        if name in _REGISTRY:
            raise ValueError(f"schedule {name!r} is registered twice")
        _REGISTRY[name] = ScheduleInfo(
            name=name,
            generator=generator,
            summary=summary,
            paper=paper,
            placement=placement,
            virtual_stages=virtual_stages,
            default_virtual_stages=default_virtual_stages,
            bubble=bubble,
            memory=memory,
            transfer=transfer,
            synchronous=synchronous,
            build=build,
        )
        return generator

    return add


def schedule_names(*, synchronous: bool | None = None) -> list[str]:
    """The registered schedules in table order; ``synchronous=True`` / ``False``: only those that flush / do not."""
    return [n for n, info in _REGISTRY.items() if synchronous is None or info.synchronous == synchronous]


#: other names a user writes for a schedule (besides case, and ``_`` or nothing for ``-``)
ALIASES = {
    "interleaved": "interleaved-1f1b",
    "1f1b-interleaved": "interleaved-1f1b",
    "pipedream-flush": "1f1b",
}


def _key(name: str) -> str:
    """What a name is compared by: case, spaces, ``-`` and ``_`` do not count."""
    return "".join(c for c in name.lower() if c not in " -_")


def canonical_name(name: str) -> str:
    """The registered name ``name`` means: itself, another case of it (``"1F1B"``), with ``_`` or no ``-``
    (``"zb_v"``), or an alias (``"interleaved"``); a ValueError with a did-you-mean and the list otherwise."""
    if name in _REGISTRY:
        return name
    if not isinstance(name, str):
        raise TypeError(f"a schedule name is a str, got {type(name).__name__}")
    known = {_key(n): n for n in _REGISTRY} | {_key(a): n for a, n in ALIASES.items()}
    found = known.get(_key(name))
    if found is not None:
        return found
    close = difflib.get_close_matches(_key(name), list(known), n=1, cutoff=0.6)
    hint = f" did you mean {known[close[0]]!r}?" if close else ""
    raise ValueError(f"unknown schedule {name!r};{hint} registered: {', '.join(_REGISTRY)}")


def schedule_info(name: str) -> ScheduleInfo:
    """What the registry knows about schedule ``name`` (any case, or an alias: :func:`canonical_name`)."""
    return _REGISTRY[canonical_name(name)]


def is_asynchronous(schedule: str | Schedule) -> bool:
    """Whether ``schedule`` is asynchronous: a registered name by its registration, a Schedule by what it carries
    (:attr:`Schedule.is_asynchronous <stagewise.ir.Schedule.is_asynchronous>`). Every caller asks this."""
    if isinstance(schedule, str):
        return not schedule_info(schedule).synchronous
    return isinstance(schedule, Schedule) and schedule.is_asynchronous


def generate(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """The compute-only schedule ``name`` for p ranks, m micro-batches and v stages per rank."""
    info = schedule_info(name)
    v = info.default_virtual_stages if virtual_stages is None else virtual_stages
    info.check(num_ranks, num_microbatches, v)
    if info.build is not None:
        with gc_paused():  # an asynchronous window's version table holds ~0.3 M objects at 128 x 1024
            return info.build(num_ranks, num_microbatches, v)
    placement = loop_placement(num_ranks, v) if info.placement == "loop" else v_placement(num_ranks, v)
    with gc_paused():  # a generator makes up to ~1 M actions at 128 ranks x 1024 micro-batches
        ranks = info.generator(num_ranks, num_microbatches, v)
    return Schedule(
        name=info.name,
        num_microbatches=num_microbatches,
        placement=placement,
        ranks=ranks if isinstance(ranks, ActionRows) else tuple(tuple(r) for r in ranks),
        meta={"placement": info.placement},
    )


def markdown_table() -> str:
    """The README's schedule table, generated so it cannot drift from the registry.

    The bubble column assumes free transfers; the transfer column says what a transfer time c adds to the
    makespan where that is known in closed form (each one checked by brute force in tests/core).
    """
    rows = [
        "| schedule | virtual stages | bubble (uniform costs, free transfers) | a transfer time c adds "
        "| peak activations (rank 0) | paper |",
        "|---|---|---|---|---|---|",
    ]
    for info in _REGISTRY.values():
        v = "any" if info.virtual_stages is None else " or ".join(map(str, info.virtual_stages))
        rows.append(
            f"| `{info.name}` | {v} ({info.placement}) | {info.bubble} | {info.transfer} | {info.memory} "
            f"| {info.paper} |"
        )
    return "\n".join(rows)
