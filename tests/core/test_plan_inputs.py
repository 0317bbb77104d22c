"""What the planner is given and gives, as values that travel: a calibration saved and loaded, the profile's
batch, a plan's digest (what ranks compare before they run it), and the top layouts rather than the top plans."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Calibration, LayoutCost, Link, search


def _profile(batch: int | None = None) -> LayerProfile:
    times = [0.5, 1.0, 1.0, 2.0]
    layers = tuple(LayerCost(f"l{k}", t, t, t, 2 * t, 100.0, 50.0, 1000.0, 10.0) for k, t in enumerate(times))
    return LayerProfile(layers, "cpu", 3, 1, batch=batch)


def test_a_calibration_survives_saving_and_loading(tmp_path: Path) -> None:
    cal = Calibration(
        intra=Link(5e-5, math.inf),
        action=1.5e-4,
        step=3e-3,
        cores=1.7,
        sharding_fixed=1e-3,
        sharding_per_byte=2e-9,
        sharding_group=4,
        layouts=(LayoutCost(2, 2, 1, 1, 0.01, 1e-3, 2e-4, 1e-5, cpu=(0.002, 0.0, 1e-4, 0.0)),),
        background=0.012,
        processes=4,
        nodes=1,
    )
    assert Calibration.load(cal.save(tmp_path / "cal.json")) == cal
    assert Calibration.from_json(Calibration().to_json()) == Calibration()
    old = {k: v for k, v in cal.to_dict().items() if k not in ("processes", "nodes", "background")}
    assert Calibration.from_dict(old) == replace(cal, processes=None, nodes=None, background=0.0)  # an older file
    with pytest.raises(ValueError, match=r"unknown keys \['speed'\]"):
        Calibration.from_dict({"speed": 2})
    with pytest.raises(ValueError, match="a link is"):
        Calibration.from_dict({"intra": [1e-4]})
    with pytest.raises(ValueError, match=r"cal\.json: calibration: not JSON"):
        (tmp_path / "cal.json").write_text("{")
        Calibration.load(tmp_path / "cal.json")
    with pytest.raises(ValueError, match="processes must be a positive int"):
        Calibration(processes=0)


def test_the_profile_batch_scales_the_plan_and_may_only_be_repeated() -> None:
    """A profile of 2-sample micro-batches planned as one of 2 samples: every time as profile_batch=2 says."""
    at_two = sw.plan(_profile(batch=2), 2, global_batch=8)
    assert [p.step_time for p in at_two] == [
        p.step_time for p in sw.plan(_profile(), 2, global_batch=8, profile_batch=2)
    ]
    assert [p.step_time for p in at_two] == [
        p.step_time for p in sw.plan(_profile(2), 2, global_batch=8, profile_batch=2)
    ]
    per_sample = sw.plan(_profile(), 2, global_batch=8)  # no record: per sample, as before
    assert per_sample[0].step_time > at_two[0].step_time
    with pytest.raises(ValueError, match="profile_batch=3, but the profile was measured on micro-batches of 2"):
        sw.plan(_profile(batch=2), 2, global_batch=8, profile_batch=3)
    with pytest.raises(ValueError, match="LayerProfile.batch must be a positive int"):
        _profile(batch=0)


def test_a_plans_digest_names_what_runs_and_nothing_else() -> None:
    plans = sw.plan(_profile(), 4, global_batch=8, intra=Link(1e-4, 1e8), top=50)
    first = next(p for p in plans if p.layout.pp == 2 and p.partition[0] != p.partition[1])
    assert first.digest() == replace(first, step_time=99.0, bubble=0.5, why="other").digest()
    assert json.loads(json.dumps(first.to_dict()))["digest"] == first.digest()
    changed = [
        replace(first, partition=tuple(reversed(first.partition))),
        replace(first, microbatches=first.microbatches * 2),
        replace(first, schedule="gpipe" if first.schedule != "gpipe" else "1f1b"),
        replace(first, recompute=None if first.recompute else "stage"),
        replace(first, layout=sw.ParallelConfig(pp=first.layout.pp, dp=first.layout.dp * 2)),
    ]
    assert first.partition != tuple(reversed(first.partition))
    digests = {first.digest(), *(p.digest() for p in changed)}
    assert len(digests) == 1 + len(changed)
    assert len({p.digest() for p in plans}) == len(plans)  # distinct plans, distinct digests


def test_best_per_layout_equals_the_best_of_each_layout_in_the_whole_ranking() -> None:
    """Pruning per layout keeps each layout's best: the same plans as ranking everything and keeping the first
    of each layout, for several problems (one where one layout wins every top place)."""
    for profile, processes, link in ((_profile(), 4, Link(1e-4, 1e8)), (_profile(), 8, Link(1e-3, 1e6))):
        whole = search(profile, processes, global_batch=16, intra=link, top=100_000).plans
        firsts: dict[sw.ParallelConfig, float] = {}
        for p in whole:
            firsts.setdefault(p.layout, p.step_time)
        for top in (1, 3, 100):
            found = search(profile, processes, global_batch=16, intra=link, top=top, best_per_layout=True)
            assert [p.layout for p in found.plans] == list(firsts)[:top]
            assert [p.step_time for p in found.plans] == list(firsts.values())[:top]
        assert found.simulated < len(whole)  # pruned, not everything simulated
