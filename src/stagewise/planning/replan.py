"""Whether to re-plan a running job (issue 49 item 3): pure arithmetic, no torch, every decision a plain record.

A change of plan pays when what it saves over the steps left exceeds what it costs: the re-layout's seconds
(measured on the last re-layout, else predicted from the bytes to move, :func:`relayout_seconds`) plus a
margin that absorbs the cost model's error. So :func:`decide` takes the plan running and its candidates
(schedule x cut at the same members, each with the step the calibrated model predicts for it; for a straggler,
the cut for the measured speeds), and changes only when ``(now - best) x steps_left > relayout_s + margin_s``.
The margin is not a fixed figure: it is what the gain's own evidence leaves uncertain, :func:`noise_margin`.
The predicted saving per step rests on estimates (the calibration's stage costs, the ranks' measured speeds): an
error in those is an error of every step's saving, so it counts once per step left; the steps' own noise
(:func:`step_spread`) averages out over the steps left (it counts as their square root), so it shrinks against
the gain as the steps left grow, and a speed measured alike over several steps (a small standard error) is
strong evidence. A gain inside that interval is never taken; a real slowdown, larger, is.
A cooldown (steps since the last change) keeps it from flapping: a plan just taken is never left before
``cooldown`` steps, whatever a noisy step predicts, so A -> B -> A within the cooldown cannot happen.

Every decision, taken or not, is a JSON-able dict that holds all its inputs: :func:`replay` re-decides a log
and gives the same records, which is how a run's re-plans are audited and re-run (each segment a fresh job of
its layout).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._util import is_count, is_finite_number
from .recalibrate import Z85

if TYPE_CHECKING:
    from ..ir import Schedule
    from ..partition import LayerProfile
    from .recalibrate import RunCalibration

#: reasons a decision records
CHANGE, NO_BETTER, COOLDOWN, NOT_WORTH = "re-plan", "no better plan", "in cooldown", "gain below cost"


@dataclass(frozen=True)
class Option:
    """A plan the job could run: its schedule, its cut (layers per stage) and the predicted step (seconds)."""

    schedule: str
    counts: tuple[int, ...]
    step_s: float

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "counts": list(self.counts), "step_s": self.step_s}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Option:
        return Option(str(data["schedule"]), tuple(int(c) for c in data["counts"]), float(data["step_s"]))

    def same_plan(self, other: Option) -> bool:
        return (self.schedule, self.counts) == (other.schedule, other.counts)


def options_for(
    calibration: RunCalibration,
    prior: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    speeds: Sequence[float],
    others: Sequence[Schedule] = (),
    caps: Sequence[float] | None = None,
) -> tuple[Option, list[Option]]:
    """(the plan running, the candidates): for ``schedule`` and each of ``others`` (same ranks), the cut for the
    ranks' ``speeds`` on the calibrated layers, with its predicted step; the running cut is a candidate too. A
    rank with ``caps`` below 1 (held by a quota) is priced by its cap in every plan, the running one too, so that
    the gain compares two predictions of one model (:func:`~stagewise.planning.stragglers.priced`)."""
    from ..partition import partition_costs
    from .stragglers import cut_for_speeds

    profile = calibration.profile(prior)
    best, now, after = cut_for_speeds(profile, schedule, counts, speeds, calibration, caps)
    current = Option(schedule.name, tuple(int(c) for c in counts), now)
    out = [current, Option(schedule.name, tuple(best), after)]
    for other in others:
        if other.name == schedule.name:
            continue
        first = [c if c < 1 else float(s) for s, c in zip(speeds, caps or [1.0] * len(speeds))]
        stage_speeds = [first[r] for r in other.placement]
        start = partition_costs(profile.times(), other.num_stages, speeds=stage_speeds).counts
        cut, _, predicted = cut_for_speeds(profile, other, start, speeds, calibration, caps)
        out.append(Option(other.name, tuple(cut), predicted))
    return current, out


def cap_error(
    calibration: RunCalibration,
    prior: LayerProfile,
    plans: Sequence[Schedule],
    current: Option,
    candidates: Sequence[Option],
    speeds: Sequence[float],
    caps: Sequence[float],
    error: float,
) -> float:
    """The relative error of the per-step saving of the fastest candidate over the plan running that the held
    ranks' caps carry (each cap known to ``error`` in log, :meth:`~stagewise.planning.stragglers.Caps.error`):
    both re-priced with every cap ``exp(+-error)`` times, the larger change of their difference over the running
    step. A cut that sets the step by the held rank's cap moves with it, one set by its peers does not: so two
    cuts alike but for which of them the cap binds are told apart by their error, not by a probe's noise."""
    from .capped import priced

    best = fastest_other(current, candidates)
    if best is None or error <= 0 or all(c >= 1 for c in caps) or current.step_s <= 0:
        return 0.0
    profile = calibration.profile(prior)
    by_name = {p.name: p for p in plans}

    def saving(factor: float) -> float:
        scaled = [min(c * factor, 1 - 1e-9) if c < 1 else 1.0 for c in caps]
        now = priced(profile, by_name[current.schedule], current.counts, speeds, calibration, scaled)[0]
        return now - priced(profile, by_name[best.schedule], best.counts, speeds, calibration, scaled)[0]

    base = saving(1.0)
    return max(abs(saving(math.exp(e)) - base) for e in (error, -error)) / current.step_s


def step_spread(steps: Sequence[float]) -> float:
    """The steps' relative step-to-step spread: the median of ``|s[i] - s[i-1]|`` over sqrt 2, over the median
    step (0 for fewer than 2 steps). Successive differences, because a level shift (a throttled rank, a change
    of plan) is one outlying difference the median ignores, where the spread of the steps themselves would count
    the shift as noise and block the re-plan it calls for; over sqrt 2, because a difference of two independent
    steps spreads sqrt 2 times one, so that for steady noise this is the half-interquartile figure of
    :attr:`~stagewise.planning.recalibrate.RunCalibration.spread` (both 0.67 sigma for normal noise)."""
    if len(steps) < 2:
        return 0.0
    med = statistics.median(steps)
    diff = statistics.median(abs(b - a) for a, b in zip(steps, steps[1:]))
    return diff / math.sqrt(2) / med if med > 0 else 0.0


def noise_margin(
    step_s: float,
    steps_left: int,
    *,
    spread: float = 0.0,
    uncertainty: float = 0.0,
    speed_error: float = 0.0,
    z: float = Z85,
) -> float:
    """The margin a predicted gain over ``steps_left`` steps must clear beside the re-layout's cost, for a running
    step of ``step_s`` seconds: ``z`` standard errors of the total saving, ``z step_s sqrt((n e)^2 + n spread^2)``
    with ``n`` the steps left. ``e``: the per-step saving's relative error from its estimates (the calibration's
    ``uncertainty`` and the ranks' ``speed_error``, independent: root sum of squares), the same on every step;
    ``spread``: each step's own relative noise (:func:`step_spread`), independent from step to step."""
    if min(step_s, steps_left, spread, uncertainty, speed_error, z) < 0:
        raise ValueError(
            "noise_margin: step_s, steps_left, spread, uncertainty, speed_error and z must be >= 0, got "
            f"{step_s}, {steps_left}, {spread}, {uncertainty}, {speed_error}, {z}"
        )
    n = float(steps_left)
    return z * step_s * math.sqrt((n * math.hypot(uncertainty, speed_error)) ** 2 + n * spread**2)


#: a re-layout's seconds beyond moving the state, before one was measured: new groups and the stages rebuilt
#: (the replan_live check's 2-process re-layouts of 8 tiny layers took 0.04-0.06 s at load 8; a real model
#: rebuilds more: 1 s is a cautious start, replaced by the measured seconds after the first re-layout)
REBUILD_S = 1.0
#: the state moved per parameter byte, before a re-layout was measured: the weights and Adam's two moments
STATE_PER_PARAMETER_BYTE = 3.0


def first_relayout_s(parameter_bytes: float, num_ranks: int, bandwidth: float) -> float:
    """A re-layout's cost before any was measured: every rank's state (:data:`STATE_PER_PARAMETER_BYTE` x its
    ``parameter_bytes``) over the link plus :data:`REBUILD_S`; the rebuild alone where no link is known (0)."""
    state = parameter_bytes * num_ranks * STATE_PER_PARAMETER_BYTE
    return relayout_seconds(state, bandwidth, REBUILD_S) if bandwidth > 0 else REBUILD_S


def relayout_changes(best: dict[str, Any], running: str, num_ranks: int) -> dict[str, Any]:
    """What ``Pipeline.relayout`` is given for a decision's ``best`` option (its schedule and layer counts) from
    the ``running`` schedule at ``num_ranks``: the cut, and the schedule with its stages per rank when it changes."""
    changes: dict[str, Any] = {"partition": list(best["counts"])}
    if best["schedule"] != running:
        changes["schedule"] = best["schedule"]
        per_rank = len(best["counts"]) // num_ranks
        if per_rank > 1:
            changes["virtual_stages"] = per_rank
    return changes


def relayout_seconds(state_bytes: float, bandwidth: float, fixed_s: float) -> float:
    """A re-layout's predicted cost before one was measured: the state moved over the link plus the rebuild."""
    if bandwidth <= 0:
        raise ValueError(f"relayout_seconds: bandwidth must be > 0 bytes/s, got {bandwidth}")
    return state_bytes / bandwidth + fixed_s


def relayout_cost(measured: Sequence[float], predicted: float) -> float:
    """The seconds to charge the next re-layout: the last one ``measured`` in this process, unless that was the
    first, whose figure holds one-off costs a later one does not pay (its ``build`` part: 3.4 s against 0.06 s
    for the second in one run; 1.77 s in all against 0.15 s and 0.09 s for the next two in another): after the
    first alone, the smaller of it and ``predicted`` (the cost expected before any was measured,
    :func:`relayout_seconds`); ``predicted`` before any. A first-time figure charged to a move back refused one
    worth 5.1 s over the steps left (2.3 s of re-layout + a 3.7 s margin)."""
    if predicted < 0 or any(m < 0 for m in measured):
        raise ValueError(f"relayout_cost: seconds must be >= 0, got measured {list(measured)}, predicted {predicted}")
    if not measured:
        return float(predicted)
    if len(measured) == 1:
        return min(float(measured[0]), float(predicted))
    return float(measured[-1])


def decide(
    step: int,
    current: Option,
    candidates: Sequence[Option],
    *,
    steps_left: int,
    relayout_s: float,
    margin_s: float,
    cooldown: int,
    last_change: int | None,
    spread: float | None = None,
    uncertainty: float | None = None,
    speed_error: float | None = None,
) -> dict[str, Any]:
    """The decision at ``step`` (a plain record; ``taken`` says whether to change to ``best``); ``spread``,
    ``uncertainty`` and ``speed_error``: what ``margin_s`` was drawn from (:func:`noise_margin`), recorded for the
    audit (the last two only when given)."""
    if steps_left < 0 or relayout_s < 0 or margin_s < 0 or cooldown < 0:
        raise ValueError(
            "decide: steps_left, relayout_s, margin_s and cooldown must be >= 0, got "
            f"{steps_left}, {relayout_s}, {margin_s}, {cooldown}"
        )
    best = fastest_other(current, candidates)
    gain = 0.0 if best is None else (current.step_s - best.step_s) * steps_left
    if best is None or best.step_s >= current.step_s:
        reason = NO_BETTER
    elif last_change is not None and step - last_change < cooldown:
        reason = COOLDOWN
    elif gain <= relayout_s + margin_s:
        reason = NOT_WORTH
    else:
        reason = CHANGE
    record = {
        "event": "replan",
        "step": step,
        "taken": reason == CHANGE,
        "reason": reason,
        "current": current.to_json(),
        "best": None if best is None else best.to_json(),
        "candidates": [c.to_json() for c in candidates],
        "gain_s": gain,
        "steps_left": steps_left,
        "relayout_s": relayout_s,
        "margin_s": margin_s,
        "spread": spread,
        "cooldown": cooldown,
        "last_change": last_change,
    }
    if uncertainty is not None:
        record["uncertainty"] = uncertainty
    if speed_error is not None:
        record["speed_error"] = speed_error
    return record


def fastest_other(current: Option, candidates: Sequence[Option]) -> Option | None:
    """The fastest candidate that is not the plan running (ties broken by name and cut), None if none."""
    others = [c for c in candidates if not c.same_plan(current)]
    return min(others, key=lambda c: (c.step_s, c.schedule, c.counts), default=None)


def moved_share(current: Option, other: Option) -> float:
    """The largest share of a stage of ``other`` made of layers that stage does not hold in ``current`` (1 for
    another schedule). A calibration's error in a stage's cost is measured back in its rank's speed (a speed is
    the calibrated cost over the time taken), so the running cut is predicted exactly whatever the error, and only
    the layers a change moves to another stage carry it into the prediction of the new cut."""
    if current.schedule != other.schedule or len(current.counts) != len(other.counts):
        return 1.0
    share, a, c = 0.0, 0, 0
    for was, now in zip(current.counts, other.counts):
        kept = max(0, min(a + was, c + now) - max(a, c))
        share = max(share, (now - kept) / now if now else 0.0)
        a, c = a + was, c + now
    return share


def line(record: dict[str, Any]) -> str:
    """One log line for a decision."""
    cur, best = record["current"], record["best"]
    head = f"stagewise: re-plan at step {record['step']}: "
    if best is None:
        return head + "no other plan to consider"
    what = (
        f"{cur['schedule']} {cur['counts']} ({cur['step_s'] * 1e3:.1f} ms) -> "
        f"{best['schedule']} {best['counts']} ({best['step_s'] * 1e3:.1f} ms): gain {record['gain_s']:.2f} s over "
        f"{record['steps_left']} steps against {record['relayout_s']:.2f} s of re-layout + {record['margin_s']:.2f} s"
    )
    return head + ("applied: " if record["taken"] else f"kept ({record['reason']}): ") + what


class Decisions:
    """The decisions of one run: remembers the last change (for the cooldown) and keeps the log.

    A decision's margin is ``margin_s`` (a fixed part, 0 by default) plus :func:`noise_margin` of what
    :meth:`consider` is given, with ``z``."""

    def __init__(self, *, margin_s: float = 0.0, cooldown: int, z: float = Z85) -> None:
        if not (is_finite_number(margin_s, 0) and is_finite_number(z, 0)):
            raise ValueError(f"margin_s (seconds) and z (spreads) must be finite numbers >= 0, got {margin_s!r}, {z!r}")
        if not is_count(cooldown, 0):
            raise ValueError(f"cooldown (steps between changes) must be an int >= 0, got {cooldown!r}")
        self.margin_s, self.cooldown, self.z = float(margin_s), int(cooldown), float(z)
        self.last_change: int | None = None
        self.log: list[dict[str, Any]] = []

    def consider(
        self,
        step: int,
        current: Option,
        candidates: Sequence[Option],
        *,
        steps_left: int,
        relayout_s: float,
        spread: float | None = None,
        uncertainty: float = 0.0,
        speed_error: float = 0.0,
        speeds_measured: bool = False,
    ) -> dict[str, Any]:
        """Decide and log; ``spread``: the steps' step-to-step spread; ``uncertainty``: the calibration's own
        relative error (:attr:`~stagewise.planning.recalibrate.RunCalibration.uncertainty`), counted whole, or
        on the :func:`moved_share` of the fastest candidate when the ranks' speeds were measured against that
        calibration (``speeds_measured``); ``speed_error``: the measured speeds'
        (:func:`~stagewise.planning.stragglers.speed_error`)."""
        if uncertainty < 0 or speed_error < 0:
            raise ValueError(
                f"Decisions.consider: uncertainty and speed_error must be >= 0, got {uncertainty}, {speed_error}"
            )
        best = fastest_other(current, candidates)
        moved = 1.0 if best is None or not speeds_measured else moved_share(current, best)
        noise = noise_margin(
            current.step_s, max(0, steps_left), spread=spread or 0.0, uncertainty=uncertainty * moved,
            speed_error=speed_error, z=self.z,
        )  # fmt: skip
        record = decide(
            step,
            current,
            candidates,
            steps_left=steps_left,
            relayout_s=relayout_s,
            margin_s=self.margin_s + noise,
            cooldown=self.cooldown,
            last_change=self.last_change,
            spread=spread,
            uncertainty=uncertainty,
            speed_error=speed_error,
        )
        self.keep(record)
        return record

    def keep(self, record: dict[str, Any]) -> None:
        """Log ``record`` and remember its change: one decided here, or one handed round from the rank that
        decided (every rank keeps the same log)."""
        if record["taken"]:
            self.last_change = int(record["step"])
        self.log.append(record)


def replay(log: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions a log's inputs give again (each record's margin and cooldown; the last change carried)."""
    out: list[dict[str, Any]] = []
    last: int | None = None
    for r in log:
        d = decide(
            int(r["step"]),
            Option.from_json(r["current"]),
            [Option.from_json(c) for c in r["candidates"]],
            steps_left=int(r["steps_left"]),
            relayout_s=float(r["relayout_s"]),
            margin_s=float(r["margin_s"]),
            cooldown=int(r["cooldown"]),
            last_change=last,
            spread=r.get("spread"),
            uncertainty=r.get("uncertainty"),
            speed_error=r.get("speed_error"),
        )
        if d["taken"]:
            last = d["step"]
        for audit in ("caps", "priced_at"):  # what the candidates were priced with, and when: not inputs
            if audit in r:
                d[audit] = r[audit]
        out.append(d)
    return out
