"""What the runtime measured on the actual group that a layer profile cannot see (the pure half of calibration).

``stagewise.calibrate()`` (runtime) fills one in; :func:`stagewise.plan` takes it as ``calibration=``.
How each field enters the predicted step is written out in :mod:`stagewise.planning.costing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .comm import Link


@dataclass(frozen=True)
class Calibration:
    """Measured costs: links, the runtime's own cost per action and per message, and FSDP2's cost per layer.

    ``intra`` / ``inter``: links from a ping-pong inside a node and between two nodes (None: not
    measured; the plan's own ``intra=`` / ``inter=`` win). ``action``: seconds the runtime spends per
    stage compute action (F, and B or the I + W pair) beyond the layers' own time. ``message``:
    seconds of a rank's time per point-to-point message it posts or receives (0 when the link
    latency already holds it). ``step``: seconds per training step outside the schedule's actions
    (splitting the batch, the loss reduction, the step's bookkeeping). ``cores``: the cores a
    node's processes effectively share, measured (used when the plan gives no ``cores=``). ``sharding_fixed`` +
    ``sharding_per_byte`` x bytes: seconds one FSDP2 unit (a layer with parameters) costs per step
    for its gather and reduce-scatter, measured on ``sharding_group`` ranks (None: the ring model
    of :mod:`.comm`).
    """

    intra: Link | None = None
    inter: Link | None = None
    action: float = 0.0
    message: float = 0.0
    step: float = 0.0
    cores: float | None = None
    sharding_fixed: float | None = None
    sharding_per_byte: float | None = None
    sharding_group: int = 0

    def __post_init__(self) -> None:
        for name in ("action", "message", "step"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"Calibration.{name} must be seconds >= 0, got {value!r}")
        if self.cores is not None and not 0 < self.cores < math.inf:
            raise ValueError(f"Calibration.cores must be > 0 (cores per node), got {self.cores!r}")
        measured = (self.sharding_fixed, self.sharding_per_byte)
        if (measured[0] is None) != (measured[1] is None):
            raise ValueError("Calibration: give sharding_fixed and sharding_per_byte together, or neither")
        if measured[0] is not None:
            if not all(0 <= x < math.inf for x in measured if x is not None):
                raise ValueError(f"Calibration: sharding costs must be finite and >= 0, got {measured}")
            if self.sharding_group < 2:
                raise ValueError(f"Calibration.sharding_group must be >= 2 ranks, got {self.sharding_group}")

    def sharding_time(self, nbytes: float, units: int, n: int) -> float | None:
        """Seconds of gather + reduce-scatter per step for ``units`` layers of ``nbytes`` on ``n`` ranks (None: not
        measured).

        Measured on ``g = sharding_group`` ranks; other group sizes follow the ring's shape: the
        per-unit part scales as ``(n - 1) / (g - 1)`` (one latency per ring step), the per-byte
        part as ``((n - 1) / n) / ((g - 1) / g)``.
        """
        if self.sharding_fixed is None or self.sharding_per_byte is None or n <= 1:
            return None if self.sharding_fixed is None else 0.0
        g = self.sharding_group
        steps = (n - 1) / (g - 1)
        share = ((n - 1) / n) / ((g - 1) / g)
        return units * self.sharding_fixed * steps + nbytes * self.sharding_per_byte * share

    def to_dict(self) -> dict[str, object]:
        def link(x: Link | None) -> list[float] | None:
            return None if x is None else [x.latency, x.bandwidth]

        return {
            "intra": link(self.intra),
            "inter": link(self.inter),
            "action": self.action,
            "message": self.message,
            "step": self.step,
            "cores": self.cores,
            "sharding_fixed": self.sharding_fixed,
            "sharding_per_byte": self.sharding_per_byte,
            "sharding_group": self.sharding_group,
        }
