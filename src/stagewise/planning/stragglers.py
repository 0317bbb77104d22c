"""A slow rank, told apart from a costly layer (issue 49 item 3): pure arithmetic on the run's timelines.

One cost model, two factors, as HetPipe's ``speeds=``: a layer costs what the calibration measured
(:class:`~stagewise.planning.recalibrate.RunCalibration`, taken while every rank ran at its usual pace), and a
rank runs at a speed, 1 when calibrated. A later step's speed of rank ``r`` is what its compute actions cost
by the calibration over what they took in that step from the moment each could start (:func:`own_spans`: a CPU
quota stops a process between its actions as often as inside them), each on a core of its own (processor sharing
undone, as :func:`~stagewise.planning.recalibrate.deshared` does): a layer's cost moves every rank holding it
alike, a slow rank moves alone. A rank is named when the median of its last :data:`WINDOW` speeds, each relative to that
step's fastest rank (:class:`Detector`), falls below :data:`SLOW` (so two preempted steps name nobody, and a
rank held to half a core is named on its third slow step), and cleared when it rises above :data:`RECOVERED`.

For the speeds measured, :func:`cut_for_speeds` gives the cut the planner would choose (the min-max cut of
the calibrated layer costs, each stage's divided by its rank's speed, improved boundary by boundary by the
predicted step, :func:`~stagewise.planning.defaults.improved_counts`) and the step the model predicts for
it: what a live re-partition would apply.

A CPU quota (cgroup ``cpu.cfs_quota_us``) is a cap on a rank's share of a core, not a speed: once a re-cut
leaves the held rank little work, it no longer uses its quota up, its steps show nothing of the cap, and when
the quota lifts the timeline cannot say so. So a rank held slow is also probed, now and then, with a short
busy loop, every rank at once (its CPU time over its wall time: the share of a core each gets when it wants a
whole one, :func:`lifted`); when that share is back above :data:`RECOVERED` of a free rank's (:func:`reference`)
the rank is taken at full speed again.
Below that, the share is the rank's cap (:class:`Caps`), which the cuts are priced by
(:func:`~stagewise.planning.capped.priced`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir import Event, Schedule, Timeline
from ..partition import LayerProfile, partition_costs
from .capped import priced
from .capped import slowed as slowed  # re-exported: from_run imports it from here
from .defaults import improved_counts
from .own_time import own_spans
from .recalibrate import Z85, RunCalibration, deshared

#: steps whose median speed decides (5: a rank is named on the third of 5 slow steps, within the 5 steps issue
#: 49 allows, and two preempted steps of 5 are outvoted: the smoke runs on a 2-core machine at load 8 showed
#: single steps of a full-speed rank at 0.6-0.7 of its peer)
WINDOW = 5
#: the last steps of the window whose median is a rank's speed (:meth:`Detector.speeds`)
RECENT = 3
#: a rank below this share of its calibrated speed is named (the step-to-step spread on a shared 2-core
#: machine reaches 10-15 %; a rank held to half a core runs at 0.5)
SLOW = 0.8
#: a named rank back above this share is cleared
RECOVERED = 0.9
#: the steps whose speeds' successive differences measure a rank's step-to-step noise (:func:`speed_error`)
NOISE_STEPS = 20
#: the least relative error a window of speeds is granted (:func:`speed_error`): a quiet machine's steps agree
#: to a percent or two, and a cut moves whole layers, so a gain of a few percent is not worth a re-layout's risk
LEAST_ERROR = 0.02


def rank_speeds(timeline: Timeline, calibration: RunCalibration, num_ranks: int) -> list[float]:
    """Each rank's speed in one step: the calibrated seconds of its compute actions over the seconds it spent on
    them from the moment each could start (:func:`own_spans`, de-shared), 1.0 for a rank that computed nothing.

    From when it could start, not from when it started: a rank held by a CPU quota (cgroup ``cpu.cfs_quota_us``)
    is stopped wherever its quota runs out, in a send, a receive already satisfied or between actions as often
    as inside one, and every thread of the process spends that quota (gloo's among them): a rank at 25 % of a
    core, judged by its actions alone, was predicted at 141 ms a step that ran 240 ms. The time from an action's
    inputs being there to its end holds all of it; a wait for a peer's output is not counted. That time holds the
    rank's own work between its actions too (posting its messages, the interpreter), and an input counts as
    there only once its producer posted it (:func:`own_spans`): a slowed rank's late sends are its own time,
    not its peer's."""
    nodes = calibration.nodes if calibration.local is not None and len(calibration.nodes) == num_ranks else None
    local = calibration.local[0] if calibration.local is not None else 0.0
    spans = own_spans(timeline, calibration.cores, calibration.latency, nodes, local)
    return _speeds(spans, calibration, num_ranks)


def compute_speeds(timeline: Timeline, calibration: RunCalibration, num_ranks: int) -> list[float]:
    """Each rank's speed inside its compute actions alone (their calibrated seconds over their de-shared
    seconds): what a calibration taken on a slowed rank must undo to find its layers' own costs (the quota's
    stops outside the actions are not the layers' cost)."""
    return _speeds(deshared(timeline, calibration.cores), calibration, num_ranks)


def _speeds(spans: Sequence[tuple[Event, float]], calibration: RunCalibration, num_ranks: int) -> list[float]:
    """Per rank, the calibrated seconds of its measured actions over the seconds ``spans`` gives them (1 without)."""
    expected = [0.0] * num_ranks
    took = [0.0] * num_ranks
    for e, own in spans:
        cost = calibration.measured.get(e.action.kind, {}).get(e.action.stage)
        if cost is None:
            continue
        expected[e.rank] += cost
        took[e.rank] += own
    return [x / t if t > 0 else 1.0 for x, t in zip(expected, took)]


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its speed (the median of the window that named it), and the cut for the ranks' recent
    speeds (:meth:`Detector.speeds`)."""

    rank: int
    speed: float
    speeds: tuple[float, ...]
    counts: tuple[int, ...]
    now: float
    after: float

    def line(self) -> str:
        return (
            f"stagewise: rank {self.rank} is slow: it runs at {self.speed:.2f}x its calibrated speed "
            f"({1 / self.speed:.2f}x slower, the median of its last {WINDOW} steps, each against the step's fastest "
            f"rank; the ranks' recent speeds {[round(s, 2) for s in self.speeds]}); the cut for these speeds is "
            f"{list(self.counts)}, "
            f"predicted {self.after * 1e3:.1f} ms a step against "
            f"{self.now * 1e3:.1f} ms now (stagewise.runtime.Replanner applies it live when it pays)"
        )


class Detector:
    """Feeds on each step's speeds; says who became slow (once) and who recovered.

    A step's speeds count relative to its fastest rank: a node-wide slowdown (a neighbour's job loading every
    core alike) slows every rank and names none; a straggler is slower than its peers."""

    def __init__(self, num_ranks: int) -> None:
        self.history: list[list[float]] = [[] for _ in range(num_ranks)]
        self.named: set[int] = set()

    def observe(self, speeds: Sequence[float]) -> tuple[list[int], list[int]]:
        """(ranks newly slow, ranks recovered) after this step's ``speeds``."""
        slow, back = [], []
        fastest = max(speeds) if len(speeds) and max(speeds) > 0 else 1.0
        for r, s in enumerate(s / fastest for s in speeds):
            self.history[r] = (self.history[r] + [float(s)])[-WINDOW:]
            if len(self.history[r]) < WINDOW:
                continue
            median = statistics.median(self.history[r])
            if r not in self.named and median < SLOW:
                self.named.add(r)
                slow.append(r)
            elif r in self.named and median > RECOVERED:
                self.named.discard(r)
                back.append(r)
        return slow, back

    def speeds(self) -> list[float]:
        """Each rank's current speed: the median of its last :data:`RECENT` (1.0 before it has a full window).
        Naming waits for a window's median, so that two preempted steps name nobody; once named, the speed that
        sets the cut is the recent one, so that the third slow step of a window is not outvoted by the two
        before the slowdown (a cut for half the slowdown, the first move a wrong one)."""
        return [statistics.median(h[-RECENT:]) if len(h) == WINDOW else 1.0 for h in self.history]


def lifted(speeds: Sequence[float], shares: Sequence[float], top: float | None = None) -> list[int]:
    """The ranks held slow (their known ``speeds`` below :data:`SLOW`) whose probed ``shares`` of a core (every
    rank probed at once) are back above :data:`RECOVERED` of ``top`` (:func:`reference`; the probe's largest share
    by default): the quota that held them lifted. Probed, because a held rank given little work no longer meets
    its cap, so its steps read alike whether the cap is there or not; a share, because the cap is what a quota
    sets; against a reference, because a machine loaded by others lowers every rank's share alike."""
    if len(speeds) != len(shares):
        raise ValueError(f"lifted: {len(speeds)} speeds but {len(shares)} probed shares (one per rank)")
    top = max(shares, default=0.0) if top is None else top
    if top <= 0:
        return []
    return [r for r, (s, p) in enumerate(zip(speeds, shares)) if s < SLOW and p / top > RECOVERED]


def capped_by_probe(shares: Sequence[float], held: Sequence[int], top: float) -> list[int]:
    """The ranks not ``held`` whose probed ``shares`` of a core are below :data:`SLOW` of ``top``
    (:func:`reference`): held by a quota that a probe taken for another rank saw first. A share is a direct
    reading of the cap (a free rank reads 0.97-1.00 pinned), and the steps may not show it: a calibration begun
    after the quota took hold takes the held rank's speed as its baseline (2026-12-03 07:57: rank 1 read 0.48 in
    the probe that freed rank 0, was ignored, and was named only 11 steps into its throttle)."""
    if top <= 0:
        return []
    return [r for r, p in enumerate(shares) if r not in held and p / top < SLOW]


#: the probes whose largest share is the reference a held rank's share is read against (:func:`reference`)
REFERENCE_PROBES = 3


def reference(tops: Sequence[float]) -> float:
    """The share of a core a free rank gets now, from the largest share of each probe so far (``tops``, oldest
    first): the largest of the last :data:`REFERENCE_PROBES`. A peer disturbed during one probe (sharing its core
    for a moment: read at 0.7 of its usual share on 2026-12-03) lowers that probe's largest, not the reference,
    so a held rank is not read against it as free; a machine loaded by others for longer lowers it within
    :data:`REFERENCE_PROBES` probes."""
    return max(tops[-REFERENCE_PROBES:], default=0.0)


#: the probes whose median is a held rank's cap (:class:`Caps`): one probe of 30 ms under a quota with a 10 ms
#: period read 0.22-0.31 at 25 % and 0.45-0.68 at 50 % when it was a loop's rate against its peers' (the 16:15
#: quiet run; the probe now reads its CPU time between hold-offs, :mod:`stagewise.runtime.calibration.probe`);
#: two halve the outliers' weight
CAP_PROBES = 2
#: a held rank's cap that moves by more than this factor either way since the one the last decision priced is
#: news (a deeper throttle, a partial lift): past the spread of a median of two probes (0.45-0.68 at 50 %: a
#: factor 1.5 between single probes), well inside the factor 2 between a quarter and a half of a core
CAP_NOISE = 1.4
#: a cap's relative error (of its log) before its own probes measure it: single probes read 0.22-0.31 at 25 %
#: (a sigma of about 0.14 in log), their median of two about 0.12
CAP_ERROR = 0.12
#: the probes whose successive differences measure a cap's noise (:meth:`Caps.error`)
CAP_SERIES = 8


class Caps:
    """Each held rank's cap (its share of a core, probed: :func:`priced` prices it as a cap): the median of its
    last :data:`CAP_PROBES` probed shares, each relative to a free rank's (:func:`reference`: a machine loaded by
    others lowers every rank alike), the latest alone when it differs from the one before by more than
    :data:`CAP_NOISE` (a new level: a deeper throttle, a partial lift, seen at its first probe); 1 for a rank not
    held. :meth:`moved` says whether a cap moved past its noise since
    the caps last priced (:meth:`priced_now`), which calls for a decision now."""

    def __init__(self, num_ranks: int) -> None:
        self.history: list[list[float]] = [[] for _ in range(num_ranks)]
        self.series: list[list[float]] = [[] for _ in range(num_ranks)]
        self.priced: list[float] = [1.0] * num_ranks
        self.tops: list[float] = []  # each probe's largest share (:meth:`reference`)

    def observe(self, shares: Sequence[float], held: Sequence[int], top: float | None = None) -> None:
        """A probe's ``shares`` (one per rank), read against ``top`` (:func:`reference`; the probe's largest by
        default); ``held``: the ranks held slow (the others' caps are dropped)."""
        if len(shares) != len(self.history):
            raise ValueError(f"Caps.observe: {len(shares)} probed shares for {len(self.history)} ranks")
        top = max(shares, default=0.0) if top is None else top
        for r, share in enumerate(shares):
            kept = self.history[r] + [min(share / top, 1.0)] if r in held and top > 0 else []
            if len(kept) >= 2 and _shifted(kept[-2], kept[-1]):  # a new level: the probes before it are not its
                kept = kept[-1:]
            series = self.series[r] if len(kept) > 1 else []
            self.history[r] = kept[-CAP_PROBES:]
            self.series[r] = (series + kept[-1:])[-CAP_SERIES:]

    def reference(self, shares: Sequence[float]) -> float:
        """A probe's ``shares`` read: the share of a core a free rank gets now (:func:`reference` over every
        probe's largest so far, this one's included)."""
        self.tops.append(max(shares, default=0.0))
        return reference(self.tops)

    def free(self, ranks: Sequence[int]) -> None:
        """``ranks`` are free again (their throttle lifted): no cap."""
        for r in ranks:
            self.history[r] = self.series[r] = []

    def error(self) -> float:
        """The caps' relative error (of their log): the largest held rank's, from its probes' successive
        differences as :func:`speed_error` (a level shift, a cap moving, is one difference the median ignores),
        :data:`CAP_ERROR` before 3 probes; at least :data:`LEAST_ERROR`."""
        out = 0.0
        for c, series in zip(self.caps(), self.series):
            if c < 1:
                out = max(out, speed_error(series, CAP_PROBES) if len(series) >= 3 else CAP_ERROR)
        return out

    def lower(self) -> list[float]:
        """The caps one error below their median: what a decision prices, so that of two cuts alike for the
        median it takes the one that leaves the held rank room under its cap (a probe reading high, or a quota
        that a burst outruns, costs it nothing), and a cap read a little high never moves work onto it."""
        e = self.error()
        return [c * math.exp(-e) if c < 1 else 1.0 for c in self.caps()]

    def caps(self) -> list[float]:
        """Each rank's cap; 1 where none was probed or its median is above :data:`RECOVERED` (not a quota: a rank
        slow with a whole core is slow at any work, a speed)."""
        medians = [statistics.median(h) if h else 1.0 for h in self.history]
        return [m if m <= RECOVERED else 1.0 for m in medians]

    def moved(self) -> bool:
        """Whether a cap moved by more than :data:`CAP_NOISE` since the caps last priced."""
        return any(_shifted(c, p) for c, p in zip(self.caps(), self.priced))

    def priced_now(self) -> list[float]:
        """The caps a decision prices now, :meth:`lower` (their medians remembered for :meth:`moved`)."""
        self.priced = self.caps()
        return self.lower()


def _shifted(a: float, b: float) -> bool:
    """Whether two caps differ by more than :data:`CAP_NOISE` either way."""
    return abs(math.log(max(a, 1e-9) / max(b, 1e-9))) > math.log(CAP_NOISE)


def ratio_error(errors: list[float]) -> float:
    """The relative error of the speed ratio that sets a cut: a slow rank's against the fastest, each measured
    with its own noise (the two largest errors, root sum of squares)."""
    top = sorted(errors, reverse=True)[:2]
    return math.hypot(*top) if len(top) == 2 else (top[0] if top else 0.0)


def speed_error(series: Sequence[float], window: int = RECENT) -> float:
    """The relative standard error of the median of a ``window`` of a rank's speeds, from ``series`` (its last
    :data:`NOISE_STEPS` speeds as measured, across changes of plan): the step-to-step sigma
    of their logarithm (the median size of its successive differences over 0.954, a normal's ``0.6745 sqrt 2``:
    relative, so that noise measured at full speed counts alike at half speed; a level shift, as a throttle
    starting, is one outlying difference the median ignores) times ``1.25 / sqrt(window)`` (a median's standard
    error), and at least :data:`LEAST_ERROR`: a few steps that happen to agree are not proof; ``inf`` for fewer
    than 3 speeds or one not above 0."""
    if len(series) < 3 or min(series) <= 0:
        return math.inf
    sigma = statistics.median(abs(math.log(b / a)) for a, b in zip(series, series[1:])) / 0.954
    return max(LEAST_ERROR, 1.25 * sigma / math.sqrt(window))


def speeds_moved(before: Sequence[float], now: Sequence[float], errors: Sequence[float], z: float = Z85) -> bool:
    """Whether a rank's speed moved past its noise since a decision that changed nothing: ``now`` over ``before``
    off 1 by more than ``z`` x sqrt 2 x its relative error (two readings; at least :data:`LEAST_ERROR`). Until
    one moves, the same decision would be taken again: pricing every cut, 20-45 ms of rank 0 (2026-12-04 10:50)."""
    return any(
        b <= 0 or abs(n / b - 1) > z * math.sqrt(2) * max(e, LEAST_ERROR) for b, n, e in zip(before, now, errors)
    )


def decision_errors(full: Sequence[bool], errors: Sequence[float], series: Sequence[Sequence[float]]) -> list[float]:
    """Each rank's speed error for a decision: from its recent speeds ``series`` where its window is ``full``, else
    its last error; since a lift (its error NaN) and until 3 free speeds, :data:`LEAST_ERROR` (the held steps'
    noise is not the free machine's)."""
    out = []
    for r, f in enumerate(full):
        since_lift = math.isnan(errors[r])
        if f and not (since_lift and len(series[r]) < 3):
            out.append(speed_error(series[r]))
        else:
            out.append(LEAST_ERROR if since_lift else errors[r])
    return out


def cut_for_speeds(
    calibrated: LayerProfile,
    schedule: Schedule,
    counts: Sequence[int],
    speeds: Sequence[float],
    calibration: RunCalibration,
    caps: Sequence[float] | None = None,
) -> tuple[list[int], float, float]:
    """(the cut for rank ``speeds``, the predicted step now, the predicted step with it): ``calibrated`` is the
    calibration's layer profile, ``counts`` the cut running; each stage's cost divided by its rank's speed, a
    rank with a ``caps`` below 1 priced by its cap on every cut alike (:func:`priced`), the running one too."""
    caps = list(caps) if caps is not None else [1.0] * len(speeds)
    first = [c if c < 1 else float(s) for s, c in zip(speeds, caps)]  # the min-max start: a cap as a speed
    start = partition_costs(calibrated.times(), schedule.num_stages, speeds=[first[r] for r in schedule.placement])
    best = improved_counts(start.counts, lambda c: priced(calibrated, schedule, c, speeds, calibration, caps)[0])
    now = priced(calibrated, schedule, counts, speeds, calibration, caps)[0]
    after = priced(calibrated, schedule, best, speeds, calibration, caps)[0]
    if after >= now:
        return list(counts), now, now
    return best, now, after
