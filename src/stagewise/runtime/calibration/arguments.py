"""What :class:`~.from_run.RunCalibrator` and :class:`~.replan.Replanner` are given, checked where they are
built: a wrong value failed the first calibration or decision, steps later, as a bare ``IndexError``, a
comparison's ``TypeError`` or naming the planner's internals."""

from __future__ import annotations

from collections.abc import Sequence

from ..._util import is_count, is_finite_number


def refuse_bad_arguments(
    num_ranks: int,
    after: int,
    warmup: int,
    cores: float | None,
    processes: int | None,
    speeds: Sequence[float] | None,
    caps: Sequence[float] | None,
    reduce_cpu: float,
) -> None:
    """Raise ``ValueError`` naming the argument at fault and what was expected."""
    if after < 1 or warmup < 0:
        raise ValueError(f"RunCalibrator: after must be >= 1 and warmup >= 0, got {after}, {warmup}")
    if cores is not None and not _positive(cores):
        raise ValueError(f"RunCalibrator: cores (the cores the job's processes share) must be > 0, got {cores!r}")
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int) or processes < 1):
        raise ValueError(f"RunCalibrator: processes must be an int >= 1, got {processes!r}")
    for name, values in (("speeds", speeds), ("caps", caps)):
        if values is None:
            continue
        if len(values) != num_ranks:
            raise ValueError(f"RunCalibrator: {name} needs one value per rank ({num_ranks}), got {len(values)}")
        if not all(_positive(v) for v in values):
            raise ValueError(f"RunCalibrator: {name} must be finite numbers > 0, one per rank, got {list(values)}")
    if not 0 <= reduce_cpu <= 1:
        raise ValueError(f"RunCalibrator: reduce_cpu is a share of the SYNC's time, in [0, 1], got {reduce_cpu!r}")


def refuse_bad_counts(steps: int, every: int, probe_every: int, settled_every: int, relayout_s: float | None) -> None:
    """The Replanner's step counts and its re-layout cost (its margin, z and cooldown: the decisions' own)."""
    if not (all(is_count(n, 0) for n in (steps, every, probe_every)) and is_count(settled_every)):
        raise ValueError(f"Replanner: steps, every and probe_every must be ints >= 0 and settled_every >= 1, got "
                         f"{steps!r}, {every!r}, {probe_every!r}, {settled_every!r}")  # fmt: skip
    if relayout_s is not None and not is_finite_number(relayout_s, 0):
        raise ValueError(f"Replanner: relayout_s (seconds) must be a finite number >= 0, got {relayout_s!r}")


def _positive(value: object) -> bool:
    return is_finite_number(value) and value > 0
