"""Which recorded cut a resume takes back (issue 49 item 1): plain layouts, no processes."""

from __future__ import annotations

import copy

from stagewise.runtime.checkpoint.recorded_cut import GIVEN, REPLANNED, partition_mode, recorded_counts


def layout(layers: list[list[int]], partition: str = "balanced", **pipeline: object) -> dict:
    p = {"ranks": 2, "schedule": "1f1b", "microbatches": 4, "virtual_stages": 1, "placement": [0, 1]}
    return {"world": 2, "pipeline": {**p, "layers": layers, "partition": partition, **pipeline}, "parallel": None}


SAVED = layout([[0, 3], [3, 6]])
AGAIN = layout([[0, 4], [4, 6]])


def test_the_same_layout_decided_again_takes_the_recorded_cut() -> None:
    assert recorded_counts(AGAIN, SAVED) == [3, 3]
    assert recorded_counts(SAVED, SAVED) is None  # the same cut: nothing to do


def test_anything_else_that_differs_keeps_this_build() -> None:
    assert recorded_counts(layout([[0, 4], [4, 6]], "time"), SAVED) is None  # another mode decided
    assert recorded_counts(layout([[0, 4], [4, 6]], GIVEN), SAVED) is None  # the user's counts
    assert recorded_counts(layout([[0, 4], [4, 6]], schedule="zb-h1"), SAVED) is None
    assert recorded_counts(layout([[0, 4], [4, 7]]), SAVED) is None  # another model's layers
    wider = copy.deepcopy(AGAIN)
    wider["world"] = 4
    assert recorded_counts(wider, SAVED) is None
    old = copy.deepcopy(SAVED)
    del old["pipeline"]["partition"]  # a checkpoint from before the mode was recorded
    assert recorded_counts(AGAIN, old) is None
    assert recorded_counts(AGAIN, {"world": 2, "pipeline": None}) is None  # a plain module's checkpoint


def test_the_mode_as_recorded() -> None:
    assert (partition_mode("balanced"), partition_mode([3, 3]), partition_mode((2, 4))) == ("balanced", GIVEN, GIVEN)


def test_a_cut_replanned_live_is_taken_back_by_any_build_that_decides() -> None:
    """After a live re-plan the option holds counts; the record says the run chose them (REPLANNED), so a
    restart built with "balanced" (or "time") resumes on them; a restart given counts keeps its own."""
    assert partition_mode([4, 2], replanned=[4, 2]) == REPLANNED
    assert partition_mode([4, 2], replanned=[3, 3]) == GIVEN  # counts given after the re-plan: the user's
    replanned = layout([[0, 4], [4, 6]], REPLANNED)
    assert recorded_counts(SAVED, replanned) == [4, 2]
    assert recorded_counts(layout([[0, 3], [3, 6]], "time"), replanned) == [4, 2]
    assert recorded_counts(layout([[0, 3], [3, 6]], GIVEN), replanned) is None
