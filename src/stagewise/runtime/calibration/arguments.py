"""What :class:`~.from_run.RunCalibrator` is given, checked where it is built: a wrong value failed its first
calibration, steps later, as a bare ``IndexError`` or naming the planner's internals."""

from __future__ import annotations

import math
from collections.abc import Sequence


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


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
