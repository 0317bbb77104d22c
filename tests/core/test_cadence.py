"""Which steps a settled run is watched on (issue 49 item 4, what watching costs): every step until five watched
steps running say nothing new, then one in three; a reading on the other side of what the detector holds watches
every step again."""

from __future__ import annotations

import pytest

from stagewise.planning.cadence import SETTLED_EVERY, Cadence, readings_settled
from stagewise.planning.stragglers import WINDOW, Detector


def watched(cadence: Cadence, quiet: list[bool]) -> list[int]:
    """The steps watched, from step 1, each watched step's ``quiet`` taken in turn."""
    out, step, said = [], 0, iter(quiet)
    while True:
        step += 1
        if not cadence.due(step):
            continue
        try:
            cadence.after(step, next(said))
        except StopIteration:
            return out
        out.append(step)


def test_every_step_until_settled_then_one_in_every() -> None:
    assert SETTLED_EVERY == 3
    cadence = Cadence()
    assert watched(cadence, [True] * 8) == [1, 2, 3, 4, 5, 8, 11, 14]  # the fifth quiet step relaxes
    assert cadence.settled and cadence.next == 17


def test_a_step_that_says_something_watches_every_step_again() -> None:
    cadence = Cadence(every=3, settle=2)
    steps = watched(cadence, [True, True, True, False, True, True, True])
    assert steps == [1, 2, 5, 8, 9, 10, 13]
    assert not Cadence(every=3, settle=2).settled


def test_every_one_watches_every_step() -> None:
    cadence = Cadence(every=1)
    assert watched(cadence, [True] * 10) == list(range(1, 11))
    assert not cadence.settled


@pytest.mark.parametrize("every, settle", [(0, 5), (3, -1)])
def test_a_cadence_that_cannot_run_is_refused(every: int, settle: int) -> None:
    with pytest.raises(ValueError, match="every must be >= 1 and settle >= 0"):
        Cadence(every=every, settle=settle)


def detector(*steps: list[float]) -> Detector:
    """A detector of 2 ranks fed ``steps`` (each a step's speeds)."""
    d = Detector(2)
    for speeds in steps:
        d.observe(speeds)
    return d


STEADY = [[1.0, 0.97]] * WINDOW


def test_steady_readings_are_settled() -> None:
    assert readings_settled(detector(*STEADY))


def test_a_window_not_yet_full_is_not_settled() -> None:
    assert not readings_settled(detector(*STEADY[:-1]))


def test_a_slow_reading_of_a_rank_not_named_is_not_settled() -> None:
    assert not readings_settled(detector(*STEADY, [1.0, 0.7]))
    assert readings_settled(detector(*STEADY, [1.0, 0.85]))  # within the line: not slow, not moved past it


def test_a_named_rank_read_recovered_or_slowed_further_is_not_settled() -> None:
    named = detector(*STEADY, *[[1.0, 0.5]] * 3)
    assert named.named == {1} and not readings_settled(named)  # named on a window still half fast
    named = detector(*STEADY, *[[1.0, 0.5]] * 5)
    assert named.named == {1} and readings_settled(named)
    assert not readings_settled(detector(*STEADY, *[[1.0, 0.5]] * 3, [1.0, 0.95]))  # back over RECOVERED
    assert not readings_settled(detector(*STEADY, *[[1.0, 0.5]] * 5, [1.0, 0.3]))  # deeper: 0.3 < 0.8 x 0.5
    assert not readings_settled(detector(*STEADY, *[[1.0, 0.5]] * 5, [1.0, 0.7]))  # half back: 0.7 > 0.5 / 0.8
    assert readings_settled(detector(*STEADY, *[[1.0, 0.5]] * 5, [1.0, 0.55]))


def test_a_capped_rank_is_left_to_its_probes() -> None:
    slow = detector(*STEADY, [1.0, 0.3])
    assert not readings_settled(slow, [False, False])
    assert readings_settled(slow, [False, True])
