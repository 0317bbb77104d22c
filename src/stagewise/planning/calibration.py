"""What the runtime measured on the actual group that a layer profile cannot see (the pure half of calibration).

``stagewise.calibrate()`` (runtime) fills one in; :func:`stagewise.plan` takes it as ``calibration=``.
How each field enters the predicted step is written out in :mod:`stagewise.planning.costing`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .comm import Link


@dataclass(frozen=True)
class LayoutCost:
    """Seconds per step one layout's runtime costs beyond the planner's model of it, fitted on that layout.

    ``fixed + per_unit * u + (per_microbatch + per_unit_microbatch * u) * m`` for ``u`` layers with
    parameters on a rank and ``m`` micro-batches per replica. Measured (:func:`stagewise.calibrate`)
    on trivial pipelines of the layout at u = 1, 2 and m = 2, 4, less what the planner predicts
    for those pipelines: the step-end collectives over every rank, their waits on busy cores and,
    with sharding, FSDP2's hooks around every unit's forward and backward of every micro-batch,
    which a two-rank probe and a per-step cost per unit do not see.

    ``cpu`` holds the same four terms for CPU seconds per process per step beyond the compute actions
    the planner counts (gloo's transport threads, the step's bookkeeping, collectives): on cores the
    processes share, that CPU is taken from the compute of every process on the node, which the
    wall-clock terms of a probe too small to fill the cores do not show. Fitted first, from each
    process's CPU time in the same probes; the wall-clock terms are then what the model with it still misses.
    """

    pp: int
    dp: int
    tp: int
    sharding: int
    fixed: float
    per_unit: float = 0.0
    per_microbatch: float = 0.0
    per_unit_microbatch: float = 0.0
    cpu: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        sizes = (self.pp, self.dp, self.tp, self.sharding)
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in sizes):
            raise ValueError(f"LayoutCost: pp, dp, tp, sharding must be ints >= 1, got {sizes}")
        terms = (self.fixed, self.per_unit, self.per_microbatch, self.per_unit_microbatch)
        if not all(math.isfinite(x) for x in terms):
            raise ValueError(f"LayoutCost: terms must be finite seconds, got {terms}")
        if len(self.cpu) != 4 or not all(math.isfinite(x) for x in self.cpu):
            raise ValueError(f"LayoutCost.cpu: expected 4 finite terms (seconds), got {self.cpu!r}")

    @classmethod
    def fit(
        cls,
        pp: int,
        dp: int,
        tp: int,
        sharding: int,
        residuals: dict[tuple[int, int], float],
        cpu: dict[tuple[int, int], float] | None = None,
        cross: bool = True,
    ) -> LayoutCost:
        """The terms through four measured corners ``{(u, m): seconds}`` (two unit counts x two micro-batch counts),
        slopes held >= 0; ``cpu`` (same corners, CPU seconds per process) gives :attr:`cpu` the same way.
        ``cross=False``: no term per unit and micro-batch (:func:`corner_fit`)."""
        cpu_terms = corner_fit(cpu, "LayoutCost.fit (cpu)", cross) if cpu is not None else (0.0, 0.0, 0.0, 0.0)
        return cls(pp, dp, tp, sharding, *corner_fit(residuals, "LayoutCost.fit", cross), cpu=cpu_terms)

    def at(self, units: int, microbatches: int) -> float:
        """The fitted seconds per step (never below 0: a fit's negative terms only cancel positive ones)."""
        terms = (self.fixed, self.per_unit, self.per_microbatch, self.per_unit_microbatch)
        return _bilinear(terms, units, microbatches)

    def cpu_at(self, units: int, microbatches: int) -> float:
        """The fitted CPU seconds per process per step beyond its compute actions (never below 0)."""
        return _bilinear(self.cpu, units, microbatches)

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _bilinear(terms: tuple[float, float, float, float], u: int, m: int) -> float:
    a, b, c, d = terms
    return max(0.0, a + b * u + (c + d * u) * m)


def corner_fit(
    residuals: dict[tuple[int, int], float], what: str, cross: bool = True
) -> tuple[float, float, float, float]:
    """``(fixed, per_unit, per_microbatch, per_unit_microbatch)`` through four corners ``{(u, m): seconds}``.

    A cost cannot shrink as layers or micro-batches are added: a negative slope is noise in the
    medians, and extrapolated to a real model's layers and micro-batches it would cancel real
    costs. Each slope is the mean of the two it can be read from (less the cross term), held >= 0, and
    ``fixed`` makes the mean over the corners right. ``cross=False``: no term per unit and micro-batch
    (where nothing left costs that, the cross term is the corners' noise, multiplied by u x m at a plan).
    """
    us, ms = sorted({u for u, _ in residuals}), sorted({m for _, m in residuals})
    if len(us) != 2 or len(ms) != 2 or len(residuals) != 4:
        raise ValueError(f"{what}: expected 2 x 2 corners (u, m), got {sorted(residuals)}")
    (u1, u2), (m1, m2), r = us, ms, residuals
    du, dm = u2 - u1, m2 - m1
    d = max(0.0, ((r[u2, m2] - r[u1, m2]) - (r[u2, m1] - r[u1, m1])) / (du * dm)) if cross else 0.0
    c = max(0.0, ((r[u1, m2] - r[u1, m1]) + (r[u2, m2] - r[u2, m1])) / (2 * dm) - d * (u1 + u2) / 2)
    b = max(0.0, ((r[u2, m1] - r[u1, m1]) + (r[u2, m2] - r[u1, m2])) / (2 * du) - d * (m1 + m2) / 2)
    a = sum(r[u, m] - b * u - (c + d * u) * m for u, m in r) / 4
    return a, b, c, d


@dataclass(frozen=True)
class Calibration:
    """Measured costs: links, the runtime's own cost per action and per message, and FSDP2's cost per layer.

    ``intra`` / ``inter``: links from a ping-pong inside a node and between two nodes (None: not
    measured; the plan's own ``intra=`` / ``inter=`` win). ``action``: seconds the runtime spends per
    stage compute action (F, and B or the I + W pair) beyond the layers' own time. ``message``:
    seconds of a rank's time per point-to-point message it posts or receives (0 when the link
    latency already holds it). ``step``: seconds per training step outside the schedule's actions
    (splitting the batch, the loss reduction, the step's bookkeeping); ``layouts``: what the runtime
    adds per step on each measured layout (:class:`LayoutCost`), used instead of ``step`` for that
    layout (:meth:`step_for`). ``background``: CPU seconds per second a process spends while it waits for
    nothing (measured idle: gloo's transport threads wake 100 times a second each, one per process group the
    process holds), taken from the shared cores. ``cores``: the cores a
    node's processes effectively share, measured (used when the plan gives no ``cores=``). ``sharding_fixed`` +
    ``sharding_per_byte`` x bytes: seconds one FSDP2 unit (a layer with parameters) costs per step
    for its gather and reduce-scatter, measured on ``sharding_group`` ranks (None: the ring model
    of :mod:`.comm`). ``sharding_hooks``: the CPU seconds FSDP2's hooks add to one unit's forward and
    backward per micro-batch (None: not measured; the layouts' fitted costs then carry it as a term
    per unit and micro-batch). ``processes`` / ``nodes``: the group it was measured on (None: not recorded); the layout
    costs and the cores hold for that many processes only. ``link_cpu``: the share of a core a message between
    nodes takes at each end while on the ``inter`` link (:func:`stagewise.runtime.measure.links.link_cpu`, probed
    where ``nodes`` > 1; 0: none), which a plan whose pipeline crosses nodes takes from its compute (on 100 Mbit/s,
    0.27-0.54: the compute ran 26-57 % slower than over a fast link).

    A calibration takes minutes to measure: :meth:`save` it, and :meth:`load` it for later plans
    (``stagewise plan --calibration FILE``).
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
    sharding_hooks: float | None = None
    layouts: tuple[LayoutCost, ...] = ()
    background: float = 0.0
    processes: int | None = None
    nodes: int | None = None
    link_cpu: float = 0.0

    def __post_init__(self) -> None:
        for name in ("action", "message", "step", "background"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"Calibration.{name} must be seconds >= 0, got {value!r}")
        if not 0 <= self.link_cpu <= 1:
            raise ValueError(f"Calibration.link_cpu is a share of a core, in [0, 1], got {self.link_cpu!r}")
        if self.cores is not None and not 0 < self.cores < math.inf:
            raise ValueError(f"Calibration.cores must be > 0 (cores per node), got {self.cores!r}")
        for row in self.layouts:
            if not isinstance(row, LayoutCost):
                raise ValueError(f"Calibration.layouts: expected LayoutCost entries, got {type(row).__name__}")
        if self.sharding_hooks is not None and not 0 <= self.sharding_hooks < math.inf:
            raise ValueError(f"Calibration.sharding_hooks must be seconds >= 0 or None, got {self.sharding_hooks!r}")
        measured = (self.sharding_fixed, self.sharding_per_byte)
        if (measured[0] is None) != (measured[1] is None):
            raise ValueError("Calibration: give sharding_fixed and sharding_per_byte together, or neither")
        if measured[0] is not None:
            if not all(0 <= x < math.inf for x in measured if x is not None):
                raise ValueError(f"Calibration: sharding costs must be finite and >= 0, got {measured}")
            if self.sharding_group < 2:
                raise ValueError(f"Calibration.sharding_group must be >= 2 ranks, got {self.sharding_group}")
        for name in ("processes", "nodes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Calibration.{name} must be a positive int or None, got {value!r}")

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

    def hooks_for(self, sharding: int) -> float:
        """Seconds per unit (a layer with parameters) that each forward and each backward of a stage costs beyond
        its layers, for a layout of ``sharding`` ranks: half of FSDP2's measured hooks each (0 unsharded or
        unmeasured)."""
        return self.sharding_hooks / 2 if sharding > 1 and self.sharding_hooks is not None else 0.0

    def step_for(self, pp: int, dp: int, tp: int, sharding: int, units: int, microbatches: int) -> float:
        """Seconds per step outside what the rest of the model predicts, for this layout with ``units`` layers with
        parameters on the rank holding most and ``microbatches`` per replica: its measured :class:`LayoutCost`;
        without one, that of the same layout at tp = 1 (tp's collectives are costed per layer); else ``step``."""
        row = self._layout(pp, dp, tp, sharding)
        return self.step if row is None else row.at(units, microbatches)

    def cpu_for(self, pp: int, dp: int, tp: int, sharding: int, units: int, microbatches: int) -> float:
        """CPU seconds per step a process of this layout with ``units`` layers with parameters spends beyond its
        compute actions (its :class:`LayoutCost`'s ``cpu`` terms, found as in :meth:`step_for`; 0 unmeasured)."""
        row = self._layout(pp, dp, tp, sharding)
        return 0.0 if row is None else row.cpu_at(units, microbatches)

    def _layout(self, pp: int, dp: int, tp: int, sharding: int) -> LayoutCost | None:
        rows = {(r.pp, r.dp, r.tp, r.sharding): r for r in self.layouts}
        for key in ((pp, dp, tp, sharding), (pp, dp, 1, sharding)):
            if key in rows:
                return rows[key]
        return None

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
            "sharding_hooks": self.sharding_hooks,
            "layouts": [row.to_dict() for row in self.layouts],
            "background": self.background,
            "processes": self.processes,
            "nodes": self.nodes,
            "link_cpu": self.link_cpu,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """The inverse of :meth:`to_dict`; an unknown key or a malformed value is an error naming it (keys a
        calibration saved before they existed take their defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"calibration: expected an object (Calibration.to_dict), got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"calibration: unknown keys {unknown}; known: {sorted(known)}")
        values = dict(data)
        try:
            for name in ("intra", "inter"):
                if values.get(name) is not None:
                    latency, bandwidth = values[name]
                    values[name] = Link(float(latency), float(bandwidth))
            values["layouts"] = tuple(
                LayoutCost(**{**row, "cpu": tuple(row.get("cpu", (0.0,) * 4))}) for row in values.get("layouts", ())
            )
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"calibration: a link is [latency, bandwidth] and a layout LayoutCost's fields ({err})"
            ) from None
        return cls(**values)

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON (``Calibration.from_json(c.to_json()) == c``)."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"calibration: not JSON ({err})") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_json` to ``path``; returns the path."""
        out = Path(path)
        out.write_text(self.to_json())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Read a calibration :meth:`save` wrote (errors name the file)."""
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"calibration {os.fspath(path)}: {err}") from None

    @property
    def links_measured(self) -> bool:
        """Whether the links were measured (else transfers and collectives cost only what the plan says)."""
        return self.intra is not None or self.inter is not None
