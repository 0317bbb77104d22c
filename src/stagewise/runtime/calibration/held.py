"""The held ranks' probes (issue 49 item 4): when a rank held slow is probed, with what, and what the probe read.

A CPU quota is a cap, not a speed: a held rank the re-cut left little work stays under its cap and its steps cannot
show the quota's lift. So, while a rank is held, every ``every`` steps every rank runs a short busy loop
(:func:`.probe.probe_shares`), and each loop probe also reads every rank's cgroup quota
(:func:`.probe.quota_shares`). A held rank whose loop reading is its quota (within :data:`QUOTA_MATCH`) is watched
through the quota alone, read every step (a few bytes, where the loop costs 30 ms of every rank): while it stays as
the loop read it nothing is probed, and when it moves (deeper, or lifted) the loop probes at once. The quota only
says when: the caps are the loop's readings, whose spread prices a cap's uncertainty (a quota read exactly would
price none, and the model's error on a capped rank is not zero: the 2026-12-04 08:00 runs, caps taken from the
quota, moved the half core's cut one layer past the best more often). A rank read capped once is a suspect,
probed again at once; twice running, it is capped (:class:`~stagewise.planning.stragglers.Caps`) though its steps
never named it. What the probes found is the :class:`~stagewise.runtime.Replanner`'s to act on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...planning.stragglers import Caps, capped_by_probe, lifted

#: a loop's reading within this of a rank's cgroup quota (shares of a core, the free ranks' reading as 1): the
#: quota is the cap (the loop read 0.48-0.49 at a half and 0.22-0.24 at a quarter, 2026-12-04)
QUOTA_MATCH = 0.1


@dataclass
class Found:
    """What one probe found: the ranks whose cap lifted (``free``), those read capped twice running (``capped``),
    every rank's share and the free ranks' reference (``top``)."""

    free: list[int]
    capped: list[int]
    shares: list[float]
    top: float


@dataclass
class HeldProbes:
    """The probes of the ranks held slow: ``loop`` and ``quota`` give every rank's share of a core and its quota
    (collectives of every rank), ``every`` steps between loop probes (0: never probe)."""

    num_ranks: int
    every: int
    loop: Callable[[], list[float]]
    quota: Callable[[], list[float | None]]
    since: int = 0  # steps since the last probe
    at: int = -1  # the step of the last call (a settled run is not watched every step)
    caps: Caps = field(init=False)
    #: every probe: the step, the ranks held, their shares, the reference they were read against, the ranks free,
    #: and by what (the loop or the quotas)
    log: list[dict[str, Any]] = field(default_factory=list)
    by_quota: dict[int, float] = field(default_factory=dict)  # held ranks whose cap the loop read as their quota
    suspects: list[int] = field(default_factory=list)  # read capped once, unnamed: probed again at once

    def __post_init__(self) -> None:
        self.caps = Caps(self.num_ranks)

    def take(self, step: int, was: Sequence[int], now: Sequence[int] = ()) -> Found | None:
        """After a step, on every rank alike (``was``: the ranks held slow; ``now``: ranks to probe at once, named
        this step): a probe when one is due (None when not), its readings taken by the caps."""
        held = sorted(set(was) | set(now) | set(self.suspects))
        self.since, self.at = self.since + (max(1, step - self.at) if self.at >= 0 else 1), step
        watched = bool(held) and set(held) <= set(self.by_quota) and not now and not self.suspects
        due = watched or self.since >= self.every or now or self.suspects
        if not held or self.every == 0 or not due:
            return None
        self.since = 0
        if watched:  # the quotas as the loop read them: nothing to probe
            quotas = self.quota()
            if all(quotas[r] == self.by_quota[r] for r in held):
                return None
        shares, top = self._read()
        free = lifted([0.0 if r in was else 1.0 for r in range(len(shares))], shares, top)
        for r in free:
            self.by_quota.pop(r, None)
        by = "a quota moved" if watched else "due"
        self.log.append({"step": step, "held": held, "shares": shares, "top": top, "lifted": free, "by": by})
        suspects, kept = self.suspects, [r for r in held if r not in free and r not in self.suspects]
        low = capped_by_probe(shares, kept, top)
        capped = [r for r in low if r in suspects]  # twice running: a quota (a free rank read 0.35 once, 08:13)
        self.suspects = [r for r in low if r not in suspects]
        self.caps.observe(shares, kept + capped, top)
        if free:
            self.caps.free(free)
        return Found(free, capped, shares, top)

    def _read(self) -> tuple[list[float], float]:
        """Every rank's share of a core by the loop, and the free ranks' reference; the quotas read beside it say
        which held ranks' caps are their quotas."""
        shares, quotas = self.loop(), self.quota()
        top = self.caps.reference(shares)
        self.by_quota = {
            r: q for r, q in enumerate(quotas) if q is not None and q < 1 and abs(shares[r] / top - q) <= QUOTA_MATCH
        }
        return shares, top
