"""Replanner's options are checked when it is made (no process group needed): a clear error, before any step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stagewise import build_schedule
from stagewise.runtime import Replanner


def _pipe() -> SimpleNamespace:
    return SimpleNamespace(
        schedule=build_schedule("1f1b", 2, 4), layer_ranges=[range(0, 4), range(4, 8)], layer_profile=None, num_ranks=2
    )


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="steps"):
        Replanner(_pipe(), steps=-1)
    with pytest.raises(ValueError, match="schedules= names 'no-such'"):
        Replanner(_pipe(), steps=10, schedules=["no-such"])


def test_good_options_are_kept() -> None:
    replanner = Replanner(_pipe(), steps=10, schedules=["zb-h1", "gpipe"], cooldown=3, margin_s=0.1)
    assert replanner.schedules == ("zb-h1", "gpipe") and replanner.log == []
    assert (replanner.decisions.cooldown, replanner.decisions.margin_s) == (3, 0.1)
