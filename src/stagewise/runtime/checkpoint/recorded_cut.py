"""A resume keeps the cut the saving run decided (issue 49 item 1): read back from the record, not recomputed.

A computed cut (``partition="balanced"``, the default; ``"time"``; any mode by name) is decided once, on the
group's first rank, and handed to every rank; the checkpoint (and a snapshot) records it in its layout
(``layout.pipeline.layers``, with the mode that decided it, ``layout.pipeline.partition``). A job resumed on
the same layout builds its pipeline first, which decides again, and a decision taken again may differ: the
estimate depends on the torch version's counting, ``"time"`` on a profile measured again. So
:func:`recorded_counts` compares the layout resumed into with the record, and where only the cut differs, under
the same mode, it gives the recorded counts, which :func:`stagewise.runtime.checkpoint.resume` applies with a
re-layout (the state moves exactly). Counts the user gave (``partition=[...]``) are the user's: never replaced.
A cut a live re-plan chose is recorded as :data:`REPLANNED` and taken back by any build that decides its own cut
(a restart built with ``"balanced"`` resumes on the re-planned cut, not on a fresh decision).
Pure (plain dicts), so that every rank, reading the same record, takes the same branch.
"""

from __future__ import annotations

from typing import Any

#: what the record says of a cut given as counts (no mode decided it)
GIVEN = "counts"
#: what the record says of a cut a live re-plan decided (:class:`stagewise.runtime.Replanner`): the re-layout
#: turned the option into counts, but the run, not the user, chose them
REPLANNED = "re-planned"


def partition_mode(option: Any, replanned: Any = None) -> str:
    """The ``partition`` option as the record writes it: the mode's name, :data:`REPLANNED` for the counts a live
    re-plan applied (``replanned``: the pipeline's ``replanned_cut``, the counts the Replanner set), or
    :data:`GIVEN` for counts the user gave."""
    if isinstance(option, str):
        return option
    if replanned is not None and option is not None and list(option) == list(replanned):
        return REPLANNED
    return GIVEN


def recorded_counts(now: dict[str, Any], was: dict[str, Any]) -> list[int] | None:
    """The recorded layers per stage when ``was`` (the checkpoint's layout) and ``now`` (the pipeline resumed
    into; both as :func:`.state.layout_of` writes them) differ only in their cut, decided by the same mode (or
    recorded as re-planned live, and ``now`` decided by a mode); else
    None (nothing to take back: the same cut, another layout, counts given, or a record without a mode)."""
    a, b = now.get("pipeline"), was.get("pipeline")
    if a is None or b is None or (now.get("world"), now.get("parallel")) != (was.get("world"), was.get("parallel")):
        return None
    mode = a.get("partition")
    if mode in (None, GIVEN) or b.get("partition") not in (mode, REPLANNED):
        return None
    same = ("ranks", "schedule", "microbatches", "virtual_stages", "placement")
    if any(a.get(k) != b.get(k) for k in same) or a["layers"] == b["layers"]:
        return None
    if not b["layers"] or b["layers"][-1][1] != a["layers"][-1][1] or len(b["layers"]) != len(a["layers"]):
        return None  # another model's layer count: load says what does not fit
    return [stop - start for start, stop in b["layers"]]
