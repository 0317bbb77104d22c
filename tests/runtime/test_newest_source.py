"""The one choice of where the newest whole state comes from (runtime/checkpoint/newest.py), pure: the disk's
checkpoints, the peers' snapshots and the survivors' live tensors, each reporting its step, whether its state is
whole, and the membership generation that trained it."""

from __future__ import annotations

import pytest

from stagewise.runtime.checkpoint.newest import DISK, LIVE, SNAPSHOTS, Chosen, Report, newest, ranked


def test_the_newest_step_wins_whatever_its_source() -> None:
    disk, snaps = Report(DISK, 10), Report(SNAPSHOTS, 12)
    assert newest([disk, snaps]) == Chosen(snaps)
    assert ranked([snaps, Report(DISK, 14)]) == [Report(DISK, 14), snaps]
    assert newest([]) is None and newest([Report(LIVE, 3, whole=False)]) is None


def test_a_tie_goes_to_the_cheapest_source_live_then_memory_then_disk() -> None:
    disk, snaps, live = Report(DISK, 8), Report(SNAPSHOTS, 8, holder=1), Report(LIVE, 8, holder=2)
    assert ranked([disk, snaps, live]) == [live, snaps, disk]
    assert ranked([disk, snaps]) == [snaps, disk]  # the resume's rule before: memory before disk
    two = [Report(LIVE, 8, holder=3), Report(LIVE, 8, holder=1)]
    assert [r.holder for r in ranked(two)] == [1, 3]  # among live survivors, the lowest process


def test_a_partial_live_state_only_completes_a_whole_one_of_its_step() -> None:
    """Survivors' live tensors (the lost stage's are not among them) go with the snapshots of their step; a
    survivor whose tensors are one snapshot generation behind (step 4, the committed step is 5) gives nothing."""
    at5 = Report(LIVE, 5, whole=False, holder=0)
    at4 = Report(LIVE, 4, whole=False, holder=1)
    snaps = Report(SNAPSHOTS, 5)
    chosen = newest([at4, snaps, at5, Report(DISK, 3)])
    assert chosen == Chosen(snaps, (at5,))
    assert newest([at4, Report(SNAPSHOTS, 4), at5]) == Chosen(Report(SNAPSHOTS, 4), (at4,))


def test_a_live_source_one_generation_behind_never_wins_even_with_a_newer_step() -> None:
    """Generation 1 failed after step 12 on a survivor; generation 2 went on from step 11 and its snapshots are
    of step 11 only. The survivor of generation 1 still holding step 12 holds a branch the job gave up."""
    stale = Report(LIVE, 12, generation=1)
    snaps = Report(SNAPSHOTS, 11, generation=2)
    assert newest([stale, snaps]) == Chosen(snaps)
    assert newest([Report(LIVE, 11, whole=False, generation=1), snaps]) == Chosen(snaps)  # not of its generation
    assert ranked([stale, snaps, Report(DISK, 9, generation=1)]) == [snaps, stale, Report(DISK, 9, generation=1)]
    # the same generation: the newest step, as ever
    assert newest([Report(LIVE, 12, generation=2), snaps]) == Chosen(Report(LIVE, 12, generation=2))


def test_bad_reports_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="one of .*'tape'"):
        Report("tape", 3)
    with pytest.raises(ValueError, match="snapshots source reported step -1"):
        Report(SNAPSHOTS, -1)
