"""A schedule: for each rank, the ordered tuple of actions it executes."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

from .actions import COMM, Action, Kind, parse_action
from .columns import SEND_F, SYNC, ActionRows, I

_kind_of = itemgetter(1)


def loop_placement(num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Stage ``s`` lives on rank ``s % p`` (GPipe, 1F1B, Megatron interleaving).

    p=2, v=2:  stage 0 1 2 3
               rank  0 1 0 1
    """
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))


def v_placement(num_ranks: int, virtual_stages: int = 2) -> tuple[int, ...]:
    """Stages zig-zag over the ranks (ZB-V, DualPipeV): chunk 0 goes down, chunk 1 comes back.

    p=3, v=2:  stage 0 1 2 3 4 5
               rank  0 1 2 2 1 0
    The first and the last stage share rank 0, so the loss is computed where
    the data entered and the turn-around at rank p-1 needs no transfer.
    """
    placement: list[int] = []
    for chunk in range(virtual_stages):
        ranks = range(num_ranks) if chunk % 2 == 0 else range(num_ranks - 1, -1, -1)
        placement.extend(ranks)
    return tuple(placement)


def boundary_crossings(placement: Sequence[int]) -> tuple[int, ...]:
    """Per stage, how many of its boundaries (with the stage before, with the stage after) cross to another rank:
    the messages its F and its B each post. A V's turn-around stays on a rank (p=2, v=2: 1 1 1 1, not 1 2 2 1)."""
    n = len(placement)
    return tuple(
        (s > 0 and placement[s - 1] != placement[s]) + (s < n - 1 and placement[s + 1] != placement[s])
        for s in range(n)
    )


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the facts needed to read them.

    ``placement[s]`` is the rank that holds stage ``s``; ``ranks[r]`` is rank
    r's action list, in execution order. A schedule is *compute-only* while it
    holds just F/B/I/W actions, and *complete* once the passes have added
    communication (see :mod:`stagewise.passes.lowering`). ``meta`` carries facts that
    are not actions: ``meta["forward_only"] = True`` marks an eval schedule
    (:func:`stagewise.passes.lowering.forward_only`), which the validator then checks
    for forwards only.
    """

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    #: a tuple of tuples, or (from the lowering or a column generator) an :class:`~stagewise.ir.columns.ActionRows`
    #: that acts as one
    ranks: Sequence[tuple[Action, ...]]
    meta: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"schedule {self.name!r}: num_microbatches must be >= 1, got {self.num_microbatches}")
        if not self.placement:
            raise ValueError(f"schedule {self.name!r}: no stages")
        bad = [s for s, r in enumerate(self.placement) if not 0 <= r < len(self.ranks)]
        if bad:
            raise ValueError(
                f"schedule {self.name!r}: stages {bad} are placed on ranks outside 0..{len(self.ranks) - 1}"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def virtual_stages(self) -> int:
        """Stages per rank (1 for plain pipelines, v for interleaved / V schedules)."""
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    @property
    def is_asynchronous(self) -> bool:
        """True when the schedule carries a weight-version table (``meta["versions"]``): its stages step at their
        own STEPs, a SYNC and a STEP per mini-batch (PipeDream, 2BW, XPipe). The one answer to "is this schedule
        asynchronous?" (a registered name's: :func:`stagewise.schedules.is_asynchronous`)."""
        return self.meta.get("versions") is not None

    @property
    def is_complete(self) -> bool:
        """True when the schedule carries its own communication actions."""
        # set operations over the kinds run in C: this is asked of schedules with millions of actions
        if isinstance(self.ranks, ActionRows):
            return self.num_ranks == 1 or bool(
                ((self.ranks.columns.kind >= SEND_F) & (self.ranks.columns.kind < SYNC)).any()
            )
        return self.num_ranks == 1 or any(not COMM.isdisjoint(map(_kind_of, acts)) for acts in self.ranks)

    @property
    def uses_split_backward(self) -> bool:
        if isinstance(self.ranks, ActionRows):
            return bool((self.ranks.columns.kind == I).any())
        return any(Kind.I in set(map(_kind_of, acts)) for acts in self.ranks)

    def with_ranks(self, ranks: Sequence[Iterable[Action]], name: str | None = None) -> Schedule:
        return Schedule(
            name=self.name if name is None else name,
            num_microbatches=self.num_microbatches,
            placement=self.placement,
            ranks=ranks if isinstance(ranks, ActionRows) else tuple(tuple(r) for r in ranks),
            meta=dict(self.meta),
        )

    def compute_only(self) -> Schedule:
        return self.with_ranks([[a for a in acts if a.kind.is_compute] for acts in self.ranks])

    # ---- text and CSV -------------------------------------------------
    def to_text(self) -> str:
        """One line per rank: ``rank 0: 0F0 0SEND_F0 ...``."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks))

    def to_csv(self) -> str:
        """One row per rank, one action per cell: the hand-editable form."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for acts in self.ranks:
            writer.writerow([str(a) for a in acts])
        return out.getvalue()

    def save_csv(self, path: str | Path) -> None:
        Path(path).write_text(self.to_csv())

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        name: str = "custom",
        placement: Sequence[int] | None = None,
        num_microbatches: int | None = None,
    ) -> Schedule:
        """Read a schedule written by :meth:`to_csv` or by hand.

        Row r is rank r's actions, in order; empty cells are ignored. The
        placement and micro-batch count are inferred from where each stage's
        compute runs unless given.
        """
        ranks: list[tuple[Action, ...]] = []
        for row_no, row in enumerate(csv.reader(io.StringIO(text))):
            acts = []
            for col_no, cell in enumerate(row):
                if not cell.strip():
                    continue
                try:
                    acts.append(parse_action(cell))
                except ValueError as err:
                    raise ValueError(f"schedule CSV row {row_no} (rank {row_no}), column {col_no}: {err}") from None
            ranks.append(tuple(acts))
        while ranks and not ranks[-1]:
            ranks.pop()
        if not ranks:
            raise ValueError("schedule CSV holds no actions")
        if placement is None:
            placement = infer_placement(ranks)
        if num_microbatches is None:
            mbs = [a.microbatch for acts in ranks for a in acts if a.microbatch is not None]
            num_microbatches = max(mbs) + 1 if mbs else 1
        return cls(name=name, num_microbatches=num_microbatches, placement=tuple(placement), ranks=tuple(ranks))

    @classmethod
    def load_csv(cls, path: str | Path, **kwargs: object) -> Schedule:
        """:meth:`from_csv` on a file; the schedule is named after the file."""
        path = Path(path)
        kwargs.setdefault("name", path.stem)
        return cls.from_csv(path.read_text(), **kwargs)  # type: ignore[arg-type]


def infer_placement(ranks: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Stage -> rank, read off the compute actions; each stage must live on one rank."""
    owner: dict[int, int] = {}
    for rank, acts in enumerate(ranks):
        for a in acts:
            if not a.kind.is_compute:
                continue
            if owner.setdefault(a.stage, rank) != rank:
                raise ValueError(
                    f"stage {a.stage} has compute actions on rank {owner[a.stage]} and on rank {rank} "
                    f"(e.g. {a}); a stage must live on exactly one rank"
                )
    if not owner:
        raise ValueError("cannot infer the placement: the schedule has no compute actions")
    missing = [s for s in range(max(owner) + 1) if s not in owner]
    if missing:
        raise ValueError(f"stages {missing} have no compute actions on any rank")
    return tuple(owner[s] for s in range(len(owner)))
