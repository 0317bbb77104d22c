"""The pure wave-synchronous rule (stagewise.asynchronous.wsp): the layout's checks, the clock rule against a
brute-force
statement of the bound, and the checks of the reduction's clock slots."""

from __future__ import annotations

import pytest

from stagewise.asynchronous import StalenessError, VWLayout, WaveRule, check_clocks, check_more


def test_layout_maps_ranks_and_options() -> None:
    layout = VWLayout.of([[0, 1], [2]], 3)
    assert layout.count == 2 and [layout.worker_of(r) for r in range(3)] == [0, 0, 1]
    assert layout.stages(0) == 2 and layout.per_rank([1.0, 0.5, 2.0], "speeds", 0) == [1.0, 0.5]
    with pytest.raises(ValueError, match="speeds needs one value per global rank"):
        layout.per_rank([1.0], "speeds", 0)


@pytest.mark.parametrize(
    ("workers", "world", "match"),
    [
        ([[0, 1], [1, 2]], 3, "rank 1 is in VW 0 and in VW 1"),
        ([[0, 1]], 3, r"ranks \[2\] of the world \(3 ranks\) are in no VW"),
        ([[0], []], 1, "VW 1 has no ranks"),
        ([[0, 5]], 2, "VW 0 lists rank 5, expected a global rank in 0..1"),
        ([], 2, "at least one virtual worker"),
        ("01", 2, "a list of rank lists"),
    ],
)
def test_layout_refuses(workers: object, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VWLayout.of(workers, world)  # type: ignore[arg-type]


@pytest.mark.parametrize("d", [0, 1, 2, 3])
def test_rule_is_the_bound(d: int) -> None:
    """Brute force: wave c may start once every VW finished c - 1 - D; the own updates fill the rest, once each."""
    rule = WaveRule(d)
    for c in range(8):
        needed = rule.needed_before(c)
        assert needed == max(-1, c - 1 - d)
        assert rule.check_start(0, c, needed) == min(c, d)  # the lead the rule runs at
        assert sorted(set(range(needed + 1)) | set(rule.own_terms(c))) == list(range(c))  # every own clock once
        assert not set(range(needed + 1)) & set(rule.own_terms(c))
        if c > d:
            with pytest.raises(StalenessError, match=f"{d + 1} waves ahead of the slowest VW, but the staleness"):
                rule.check_start(1, c, needed - 1)


def test_rule_refuses_bad_bounds() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness"):
            WaveRule(bad)  # type: ignore[arg-type]


def test_clock_slots() -> None:
    layout = VWLayout.of([[0, 1], [2]], 3)
    check_clocks([3.0, 3.0, 3.0], 2, layout)
    with pytest.raises(RuntimeError, match=r"the reduction of wave 2 mixes waves: rank 2 \(VW 1\) wave 3"):
        check_clocks([3.0, 3.0, 4.0], 2, layout)
    assert check_more([1, 1, 1], 0, layout) and not check_more([0, 0, 0], 0, layout)
    with pytest.raises(ValueError, match=r"VWs \[1\] end after wave 4, VWs \[0\] go on"):
        check_more([1, 1, 0], 4, layout)
