"""The simulator: a schedule timed under a cost model, with its activation memory (the planner's engine).

* :mod:`.arrays`: :func:`simulate`, every per-action fact prepared as arrays, one timing walk;
* :mod:`.earliest`: that walk, shared with the communication pass;
* :mod:`.costs`: :class:`CostModel`, per-stage F / B / I / W times, activation sizes, links;
* :mod:`.shared`: the makespan when ranks share fewer cores than processes;
* :mod:`.tied`: when a reduction the step waits for outside the action lists (a tied weights' sum) is done;
* :mod:`.asynchronous`: weight versions alive over a simulated asynchronous schedule.

The plain, action-by-action simulator the array one is tested against lives with the tests
(``tests/oracles/simulate_reference.py``).
"""

from .arrays import SimResult, simulate
from .asynchronous import AsyncReport, async_report, labelled_timeline, peak_versions
from .costs import CostModel
from .earliest import earliest_starts
from .shared import shared_makespan
from .tied import Timed, tied_done

__all__ = [
    "AsyncReport",
    "CostModel",
    "SimResult",
    "Timed",
    "async_report",
    "earliest_starts",
    "labelled_timeline",
    "peak_versions",
    "shared_makespan",
    "simulate",
    "tied_done",
]
