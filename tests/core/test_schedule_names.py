"""Schedule names as a user writes them: any case, ``_`` for ``-``, a few aliases (``interleaved`` is the README's
word for ``interleaved-1f1b``), and a did-you-mean for a misspelling; every schedule is still named canonically."""

from __future__ import annotations

import pytest

import stagewise as sw
from stagewise.schedules.registry import canonical_name


@pytest.mark.parametrize(
    ("written", "name"),
    [
        ("1F1B", "1f1b"),
        ("GPipe", "gpipe"),
        ("ZB-V", "zb-v"),
        ("zb_v", "zb-v"),
        ("interleaved", "interleaved-1f1b"),
        ("Interleaved", "interleaved-1f1b"),
        ("interleaved_1f1b", "interleaved-1f1b"),
        ("DualPipe-V", "dualpipe-v"),
        ("PipeDream-2BW", "pipedream-2bw"),
        ("  1f1b ", "1f1b"),
    ],
)
def test_a_name_in_another_case_or_an_alias_finds_the_schedule(written: str, name: str) -> None:
    assert canonical_name(written) == name
    assert sw.schedule_info(written).name == name


def test_every_registered_name_is_its_own_canonical_name() -> None:
    for name in sw.schedule_names():
        assert canonical_name(name) == name


@pytest.mark.parametrize(
    ("written", "suggested"),
    [
        ("1f1c", "1f1b"),
        ("zbv2", "zb-v"),
        ("gpip", "gpipe"),
        ("interleave", "interleaved-1f1b"),
        ("dualpipe", "dualpipe-v"),
    ],
)
def test_a_misspelt_name_gets_a_did_you_mean_and_the_list(written: str, suggested: str) -> None:
    with pytest.raises(ValueError) as info:
        sw.schedule_info(written)
    text = str(info.value)
    assert f"unknown schedule {written!r}; did you mean {suggested!r}?" in text, text
    assert "registered: naive, gpipe, 1f1b" in text, text


def test_a_name_nothing_resembles_gets_the_list_alone() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'qqqq'; registered: naive, gpipe") as info:
        sw.schedule_info("qqqq")
    assert "did you mean" not in str(info.value)


def test_a_schedule_built_from_an_alias_carries_the_canonical_name() -> None:
    assert sw.build_schedule("Interleaved", 2, 4, 2).name == "interleaved-1f1b"
    assert sw.build_schedule("1F1B", 2, 2).to_text() == sw.build_schedule("1f1b", 2, 2).to_text()
