"""torch's schedules read into stagewise (:func:`from_torch`), and stagewise's written for torch's runtime
(:func:`to_torch_csv`).

torch.distributed.pipelining keeps a schedule as ``pipeline_order``: rank -> list of actions, ``None`` for a
bubble. Its ``_PipelineScheduleRuntime`` loads one from a CSV file (a row per rank, an action per cell) in
two formats: ``compute_only`` (F, B, I, W, OVERLAP_F_B; torch adds the communication, REDUCE_GRAD, UNSHARD
and RESHARD) and ``compute_comms`` (every action it runs, communication and REDUCE_GRAD included, run as
written). torchtitan's schedule CSV option loads a file through the same loader.

Both directions go through stagewise's validator: a torch order that would compute a gradient twice or hang
is refused with the validator's explanation, and so is a stagewise schedule; a valid stagewise schedule
that torch's runtime still cannot run is refused with the reason (:func:`torch_problems`).
"""

from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..ir import Action, Kind, Schedule, loop_placement, v_placement
from ..ir.schedule import infer_placement
from ..passes import add_grad_sync, lower
from ..schedules import is_asynchronous
from ..validate import ScheduleError, validate_schedule
from .torch_words import read_action, write_actions

_log = logging.getLogger(__name__)
TorchFormat = Literal["compute_only", "compute_comms"]
FORMATS: tuple[str, ...] = ("compute_only", "compute_comms")


@dataclass(frozen=True)
class TorchOrder:
    """A schedule in torch's words: per rank, torch's action texts in order (``""`` for a bubble).

    ``name``: the torch class (``"ScheduleZBVZeroBubble"``); ``read``: what was read of it, its
    ``pipeline_order`` table or the actions its ``step()`` runs (see ``stagewise.runtime.torch_order``,
    which makes these from a class). Plain data: :func:`from_torch` reads it without torch.
    """

    name: str
    num_microbatches: int
    ranks: tuple[tuple[str, ...], ...]
    read: str = "pipeline_order"

    def to_csv(self) -> str:
        """torch's CSV form, the one ``_PipelineScheduleRuntime._dump_csv`` writes: a row per rank."""
        return _csv_rows(self.ranks)

    def save_csv(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_csv())


def from_torch(
    order: object,
    *,
    num_microbatches: int | None = None,
    name: str | None = None,
    placement: Sequence[int] | None = None,
) -> Schedule:
    """The stagewise :class:`~stagewise.ir.Schedule` of a torch order, validated.

    ``order``: a :class:`TorchOrder` (``stagewise.runtime.torch_order(ScheduleZBVZeroBubble, p=4, m=8)``);
    a built torch schedule (its ``pipeline_order``); a mapping rank -> actions (torch's ``_Action`` values,
    their text, ``None`` for a bubble); CSV text in torch's form; or the path of a CSV file.
    ``num_microbatches`` (else the order's own, else one more than the highest micro-batch),
    ``placement`` (else read off where each stage computes), ``name`` (else the class's).

    REDUCE_GRAD becomes SYNC and OVERLAP_F_B its sub-actions in order; UNSHARD and RESHARD are kept in
    ``schedule.meta["torch_annotations"]`` as (rank, position in the rank's list, text). Raises
    :class:`~stagewise.validate.ScheduleError` with the validator's explanation for an order that would
    compute wrong gradients or hang, and ``ValueError`` naming the rank and position of a word it cannot read.
    """
    rows, found_name, found_m, hint = _rows_of(order)
    ranks: list[tuple[Action, ...]] = []
    notes: list[tuple[int, int, str]] = []
    cells: dict[tuple[int, Action], int] = {}  # (rank, action) -> its position in the rank's row
    for rank, row in enumerate(rows):
        acts: list[Action] = []
        for position, item in enumerate(row):
            read = read_action(item, f"rank {rank}, position {position}")
            if read.annotation is not None:
                notes.append((rank, len(acts), read.annotation))
            acts.extend(read.actions)
            cells.update(dict.fromkeys(((rank, a) for a in read.actions), position))
        ranks.append(tuple(acts))
    if not any(ranks):
        raise ValueError("the torch order holds no actions")
    if notes:
        _log.info(
            "from_torch: %d FSDP actions (UNSHARD, RESHARD) kept in meta['torch_annotations'], not run", len(notes)
        )
    mbs = [a.microbatch for acts in ranks for a in acts if a.microbatch is not None]
    m = num_microbatches or found_m or (max(mbs) + 1 if mbs else 1)
    schedule = Schedule(
        name=name or found_name,
        num_microbatches=m,
        placement=tuple(placement) if placement is not None else infer_placement(ranks),
        ranks=tuple(ranks),
        meta={"torch_annotations": tuple(notes)} if notes else {},
    )
    try:
        validate_schedule(schedule)
    except ScheduleError as err:
        typos = _unmatched_cells(ranks, cells)
        raise ScheduleError(schedule, typos + err.problems + ([hint] if hint else [])) from None
    return schedule


def _unmatched_cells(ranks: Sequence[Sequence[Action]], cells: Mapping[tuple[int, Action], int]) -> list[str]:
    """The cells of an order whose micro-batch has no forward (a backward's) or no backward (a forward's) on
    its stage: where a typo such as ``0B2`` for ``0B1`` sits, named before the validator's counts. A cell whose
    micro-batch lies beyond its kind's count on the stage (2 among two forwards) comes first: the likely typo."""
    seen: dict[tuple[int, bool], set[int]] = {}  # (stage, is a forward) -> micro-batches
    for acts in ranks:
        for a in acts:
            if a.microbatch is not None and a.kind in (Kind.F, Kind.B, Kind.I):
                seen.setdefault((a.stage, a.kind is Kind.F), set()).add(a.microbatch)
    found: list[tuple[bool, str]] = []
    for rank, acts in enumerate(ranks):
        for a in acts:
            forward = a.kind is Kind.F
            if a.microbatch is None or not a.kind.is_compute or (a.stage, False) not in seen:
                continue  # (a stage without backwards: a forward-only order)
            other = seen.get((a.stage, not forward), set())
            if a.microbatch not in other:
                beyond = a.microbatch >= len(seen.get((a.stage, forward), ()))
                lacks = "backward" if forward else "forward"
                text = (
                    f"rank {rank}, position {cells[rank, a]}: {a}: stage {a.stage} has no {lacks} of micro-batch "
                    f"{a.microbatch} (its {lacks}s: {_short(sorted(other))}){' (a typo?)' if beyond else ''}"
                )
                found.append((not beyond, text))
    return [text for _, text in sorted(found, key=lambda f: f[0])]


def _rows_of(order: object) -> tuple[list[Sequence[object]], str, int | None, str | None]:
    """(rows in rank order, a name, the micro-batch count if the order knows it, a hint for a refusal)."""
    if isinstance(order, TorchOrder):
        hint = None
        if order.read == "pipeline_order":
            hint = (
                f"(this is {order.name}'s pipeline_order table; its step() may run another order: "
                f"stagewise.runtime.torch_order({order.name}, ..., read='step') reads the actions step() runs; "
                "on the command line, --torch-read step)"
            )
        return [list(r) for r in order.ranks], order.name, order.num_microbatches, hint
    if isinstance(order, os.PathLike):
        path = Path(order)
        return _csv_cells(path.read_text()), path.stem, None, None
    if isinstance(order, str):
        if "\n" not in order and "," not in order and order.strip().endswith(".csv"):
            raise TypeError(f"from_torch reads a str as CSV text; for the file {order!r} pass pathlib.Path({order!r})")
        return _csv_cells(order), "torch", None, None
    table = getattr(order, "pipeline_order", None)
    if table is not None:  # a built torch schedule
        return _built(order, table)
    if isinstance(order, Mapping):
        return _by_rank(order), "torch", None, None
    raise TypeError(
        "from_torch takes a TorchOrder, a torch schedule, a mapping rank -> actions, CSV text or a CSV path; "
        f"got {type(order).__name__} (a torch schedule class? build its order with "
        "stagewise.runtime.torch_order(cls, p=..., m=...))"
    )


def _built(
    order: object, table: Mapping[object, Sequence[object]]
) -> tuple[list[Sequence[object]], str, int | None, str | None]:
    """A torch schedule object: its ``pipeline_order`` table; for a runtime loaded from a compute_comms file,
    whose table stays empty, the list it runs (``pipeline_order_with_comms``)."""
    name, m = type(order).__name__, getattr(order, "_n_microbatches", None)
    m = m if isinstance(m, int) else None
    lowered = getattr(order, "pipeline_order_with_comms", None)
    if not any(table.values()) and isinstance(lowered, Mapping) and any(lowered.values()):
        return _by_rank(lowered), name, m, None
    p = getattr(order, "pp_group_size", None) or len(table)
    hint = (
        f"(this is {name}'s pipeline_order table; its step() may run another order: "
        f"from_torch(stagewise.runtime.torch_order({name}, p={p}, m={m}, read='step')) reads the actions "
        "step() runs)"
    )
    return _by_rank(table), name, m, hint


def _by_rank(table: Mapping[object, Sequence[object]]) -> list[Sequence[object]]:
    keys = sorted(table)  # type: ignore[type-var]
    if keys != list(range(len(keys))):
        raise ValueError(f"a torch order is keyed by ranks 0..p-1, got keys {keys}")
    return [table[k] for k in keys]


def _csv_cells(text: str) -> list[Sequence[object]]:
    rows: list[Sequence[object]] = list(csv.reader(io.StringIO(text)))
    while rows and not any(str(c).strip() for c in rows[-1]):
        rows.pop()
    return rows


def _csv_rows(ranks: Sequence[Sequence[str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in ranks:
        writer.writerow(row)
    return out.getvalue()


def torch_problems(schedule: Schedule) -> list[str]:
    """Why torch's ``_PipelineScheduleRuntime`` cannot run a valid stagewise schedule (empty when it can).

    * an asynchronous schedule: torch keeps one version of the weights per step;
    * a forward-only (eval) schedule: torch's loader wants a backward for every micro-batch;
    * a last stage that runs its forwards out of micro-batch order: torch keeps the losses in a list in the
      order they were computed and looks the loss of micro-batch i up at position i, so the backward of one
      micro-batch would start from another's loss.
    """
    if is_asynchronous(schedule):
        return [f"schedule {schedule.name!r} is asynchronous: torch's runtime keeps one version of the weights"]
    if schedule.meta.get("forward_only"):
        return [f"schedule {schedule.name!r} is forward-only: torch's loader wants a backward per micro-batch"]
    last = schedule.num_stages - 1
    rank = schedule.rank_of(last)
    seen = [int(a.microbatch or 0) for a in schedule.ranks[rank] if a.stage == last and a.kind is Kind.F]
    if seen != sorted(seen):
        first = next(k for k in range(len(seen)) if seen[k] != sorted(seen)[k])
        return [
            f"the last stage ({last}, on rank {rank}) runs its forwards in the order {_short(seen)}: torch's "
            f"runtime files each loss by the position its forward ran at and reads micro-batch i's at position "
            f"i, so from the forward of micro-batch {seen[first]} on, a backward would start from another "
            "micro-batch's loss; it needs them in micro-batch order"
        ]
    return []


def torch_placement(schedule: Schedule) -> str | None:
    """How torchtitan must place ``schedule``'s stages: ``"one"`` (one stage per rank, stage s on rank s: name a
    single-stage class, ``1F1B`` or ``GPipe``), ``"loop"`` (v > 1 stages per rank, stage s on rank s % p: a
    looped class such as ``Interleaved1F1B``), ``"v"`` (2 stages per rank in a V: ``ZBVZeroBubble``), or None
    (another placement: build the stages yourself, ``schedule.stages_of(rank)``).

    torchtitan decides which stages a rank builds from the schedule class it is given, not from the CSV
    (:func:`stagewise.interop.torchtitan_settings` gives every setting).
    """
    p, v = schedule.num_ranks, schedule.virtual_stages
    if p * v != schedule.num_stages:
        return None
    if tuple(schedule.placement) == loop_placement(p, v):
        return "one" if v == 1 else "loop"
    if v == 2 and tuple(schedule.placement) == v_placement(p, 2):
        return "v"
    return None


def _short(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def to_torch_csv(schedule: Schedule, *, format: TorchFormat = "compute_only") -> str:
    """``schedule`` as the CSV torch's ``_PipelineScheduleRuntime._load_csv(path, format)`` loads.

    ``format="compute_only"``: F, B, I, W in each rank's order; torch adds its own communication,
    REDUCE_GRAD and FSDP's UNSHARD / RESHARD (the file torchtitan's schedule CSV option takes).
    ``format="compute_comms"``: every action torch will run, as written: stagewise's communication
    (a compute-only schedule is lowered first), SYNC as REDUCE_GRAD (added after each stage's last
    backward where the schedule has none), no UNSHARD / RESHARD (so not for FSDP-sharded stages), no STEP.

    The schedule is validated first; one torch's runtime cannot run (:func:`torch_problems`) is refused
    with a ``ValueError`` giving the reason.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    validate_schedule(schedule)
    problems = torch_problems(schedule)
    if problems:
        raise ValueError(f"torch's runtime cannot run schedule {schedule.name!r}: " + "; ".join(problems))
    comms = format == "compute_comms"
    if comms:
        schedule = _with_comms(schedule)
    return _csv_rows([list(write_actions(tuple(acts), comms=comms)) for acts in schedule.ranks])


def _with_comms(schedule: Schedule) -> Schedule:
    """The complete schedule with a SYNC per stage (torch scales the gradients at REDUCE_GRAD), validated."""
    if not schedule.is_complete:
        return lower(schedule)
    if any(a.kind is Kind.SYNC for acts in schedule.ranks for a in acts):
        return schedule
    synced = add_grad_sync(schedule)
    validate_schedule(synced)
    return synced
