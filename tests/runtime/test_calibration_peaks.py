"""The held-out benchmark's activation peaks (benchmarks/calibration/model.peaks, peaks.py): each rank's peak
from the layers profiled alone, against timelines counted by hand. No processes."""

from __future__ import annotations

import pytest
from benchmarks.calibration.model import peaks
from benchmarks.calibration.peaks import errors, table

from helpers.profiles import fake_profile
from stagewise import build_schedule

#: 4 layers at 2 samples a micro-batch (stage 0: 10 + 20 = 30 bytes, stage 1: 30 + 40 = 70), and at 4 samples,
#: not twice (stage 0: 25 + 45 = 70, stage 1: 65 + 85 = 150)
PROFILES = {
    2: fake_profile([1.0] * 4, acts=[10.0, 20.0, 30.0, 40.0]),
    4: fake_profile([1.0] * 4, acts=[25.0, 45.0, 65.0, 85.0]),
}


def test_1f1b_holds_as_many_micro_batches_as_stages_after_it() -> None:
    """1F1B, 2 ranks, 4 micro-batches: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, two forwards alive at most (2 x 30);
    rank 1 runs F B F B ..., one (70). At 4 samples: ``before`` doubles P's bytes (120, 140), ``after`` takes the
    profile at 4 samples (2 x 70, 150)."""
    one = build_schedule("1f1b", 2, 4)
    assert peaks(PROFILES, 2, one, [2, 2], 2) == {"before": [60.0, 70.0], "after": [60.0, 70.0]}
    assert peaks(PROFILES, 2, one, [2, 2], 4) == {"before": [120.0, 140.0], "after": [140.0, 150.0]}


def test_gpipe_holds_every_micro_batch_and_the_cut_moves_the_bytes() -> None:
    """GPipe runs every forward before any backward: 4 micro-batches alive on each rank; cut [1, 3]: stage 0 10
    bytes, stage 1 90."""
    gpipe = build_schedule("gpipe", 2, 4)
    assert peaks(PROFILES, 2, gpipe, [2, 2], 2)["after"] == [120.0, 280.0]
    assert peaks(PROFILES, 2, gpipe, [1, 3], 2)["after"] == [40.0, 360.0]


def test_a_plans_error_is_its_highest_ranks_peak() -> None:
    result = {"workload": "w", "world": 2, "plans": [
        {"name": "a", "measured": [100, 200], "after": [150.0, 208.0], "before": [100.0, 192.0]},
        {"name": "b", "measured": [50, 40], "after": [50.0, 40.0], "before": [60.0, 40.0]},
    ]}  # fmt: skip
    assert errors(result, "after") == pytest.approx([0.04, 0.0])
    assert errors(result, "before") == pytest.approx([-0.04, 0.2])
    lines = table([result])
    assert lines[2] == "| w | 2 | after | 2 | 2.0% | 4.0% | 100% | a (+4.0%) |"
    assert lines[3] == "| w | 2 | before | 2 | 12.0% | 20.0% | 50% | b (+20.0%) |"
