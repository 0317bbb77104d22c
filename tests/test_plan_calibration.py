"""The calibrated cost model against closed forms: per-action and per-message costs, the CPU bound, FSDP2's cost."""

from __future__ import annotations

import math

import pytest

import stagewise as sw
from stagewise.planning import Calibration, Link, search
from stagewise.profile_data import LayerCost, LayerProfile


def _profile(n: int, t: float = 1.0, params: float = 1024.0) -> LayerProfile:
    layers = tuple(LayerCost(f"l{k}", t, t, t, 2 * t, 64.0, 32.0, params, 16.0) for k in range(n))
    return LayerProfile(layers, "synthetic", 1, 0)


def _only(profile: LayerProfile, processes: int, **kw: object) -> sw.Plan:
    kw = {"global_batch": 4, "recompute": (None,), "schedules": ["1f1b"], "top": 1000, **kw}
    return search(profile, processes, **kw).plans  # type: ignore[arg-type,return-value]


def _find(plans: object, pp: int, m: int, sharding: int = 1) -> sw.Plan:
    return next(p for p in plans if p.layout.pp == pp and p.microbatches == m and p.layout.sharding == sharding)  # type: ignore[attr-defined]


def test_action_and_message_costs_enter_each_stage_as_the_equations_say() -> None:
    """Stage s's F and B each gain action + message * ([s > 0] + [s < S-1]): at pp=4, 1 message at the ends, 2
    inside; the simulator then runs 1F1B with them (its makespan, free links: (m + p - 1) * (F + B) when even)."""
    profile = _profile(4)
    cal = Calibration(action=0.25, message=0.125)
    bare = _find(_only(profile, 4), 4, 4)
    got = _find(_only(profile, 4, calibration=cal), 4, 4)
    assert bare.costs is not None and got.costs is not None
    extra = [0.25 + 0.125 * n for n in (1, 2, 2, 1)]
    for s in range(4):
        assert got.costs.forward[s] == pytest.approx(bare.costs.forward[s] + extra[s], rel=1e-12)
        b_got = got.costs.backward_input[s] + got.costs.backward_weight[s]
        b_bare = bare.costs.backward_input[s] + bare.costs.backward_weight[s]
        assert b_got == pytest.approx(b_bare + extra[s], rel=1e-12)
    # the same terms given as action_overhead add up
    both = _find(_only(profile, 4, calibration=cal, action_overhead=0.5), 4, 4)
    assert both.costs is not None
    assert both.costs.forward[0] == pytest.approx(got.costs.forward[0] + 0.5, rel=1e-12)


def test_processes_beyond_the_cores_are_bounded_by_the_nodes_compute() -> None:
    """dp=4 on one node: each rank computes m (F + B) = 4 * 3 = 12 in 12; on 2 cores the node's 48 take 24. With 4
    cores (or none given) nothing changes; a pipeline of 4 ranks is bounded by the same 48 / 2."""
    profile = _profile(4, t=0.25)
    free = _find(_only(profile, 4), 1, 1)
    shared = _find(_only(profile, 4, cores=2), 1, 1)
    assert free.step_time == pytest.approx(3.0, rel=1e-12)  # 4 layers x (0.25 + 0.5) for one sample
    assert shared.step_time == pytest.approx(4 * 3.0 / 2, rel=1e-12)
    assert shared.breakdown["cpu_bound"] == pytest.approx(6.0) and shared.breakdown["simulated"] == pytest.approx(3.0)
    assert _find(_only(profile, 4, cores=4), 1, 1).step_time == pytest.approx(3.0, rel=1e-12)
    piped = _find(_only(profile, 4, cores=2), 4, 4)
    assert piped.step_time == pytest.approx(max(piped.breakdown["simulated"], 4 * 4 * 0.75 / 2), rel=1e-12)
    # two nodes of 2 processes, 1 core each: each node's pair of ranks over one core
    two = _find(_only(profile, 4, nodes=2, cores=1), 1, 1)
    assert two.step_time == pytest.approx(2 * 3.0, rel=1e-12)


def test_measured_sharding_cost_replaces_the_ring_and_scales_with_the_group() -> None:
    """Measured on 4 ranks: t = units * fixed + bytes * per_byte; on n ranks fixed * (n-1)/3 and
    per_byte * ((n-1)/n) / (3/4). A plan's blocking sync is exactly that (dp = 1, so no all-reduce)."""
    cal = Calibration(sharding_fixed=0.01, sharding_per_byte=1e-6, sharding_group=4)
    assert cal.sharding_time(1000.0, 3, 4) == pytest.approx(3 * 0.01 + 1000 * 1e-6)
    assert cal.sharding_time(1000.0, 3, 2) == pytest.approx(3 * 0.01 / 3 + 1000 * 1e-6 * (1 / 2) / (3 / 4))
    assert cal.sharding_time(1000.0, 3, 1) == 0.0 and Calibration().sharding_time(1.0, 1, 2) is None
    profile = _profile(4, params=4096.0)
    plans = _only(profile, 4, calibration=cal, intra=Link(1e-3, 1e6))
    sharded = _find(plans, 1, 1, sharding=4)
    assert sharded.costs is not None
    assert sharded.costs.sync_time[0] == pytest.approx(cal.sharding_time(4 * 4096.0, 4, 4), rel=1e-12)
    ring = _find(_only(profile, 4, intra=Link(1e-3, 1e6)), 1, 1, sharding=4)
    assert ring.costs is not None
    assert ring.costs.sync_time[0] == pytest.approx(2 * 3 * (1e-3 + 4 * 4096.0 / (4 * 1e6)), rel=1e-12)


def test_the_calibrations_links_are_used_unless_the_plan_names_its_own() -> None:
    profile = _profile(4)
    cal = Calibration(intra=Link(1e-3, 1e9), inter=Link(2e-3, 1e8))
    got = _find(_only(profile, 4, calibration=cal), 4, 4)
    assert got.costs is not None and got.costs.latency == 1e-3
    own = _find(_only(profile, 4, calibration=cal, intra=Link(5e-3, 1e9)), 4, 4)
    assert own.costs is not None and own.costs.latency == 5e-3
    across = _find(_only(profile, 4, calibration=cal, nodes=4), 4, 4)  # one process per node: pp crosses nodes
    assert across.costs is not None and across.costs.latency == 2e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"action": -1.0}, "Calibration.action"),
        ({"message": math.inf}, "Calibration.message"),
        ({"sharding_fixed": 0.1}, "together"),
        ({"sharding_fixed": 0.1, "sharding_per_byte": 0.0, "sharding_group": 1}, "sharding_group"),
    ],
)
def test_bad_calibrations_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Calibration(**kwargs)


def test_bad_plan_options_name_the_option() -> None:
    profile = _profile(2)
    with pytest.raises(ValueError, match="cores"):
        search(profile, 2, global_batch=2, cores=0)
    with pytest.raises(ValueError, match="calibration"):
        search(profile, 2, global_batch=2, calibration=Link())  # type: ignore[typeddict-item]
    with pytest.raises(TypeError, match="unknown option"):
        search(profile, 2, global_batch=2, core=2)  # type: ignore[typeddict-unknown-key]
    with pytest.raises(TypeError, match="global_batch"):
        sw.plan(profile, 2)  # type: ignore[call-arg]


def test_the_cost_per_step_is_paid_once_per_step() -> None:
    profile = _profile(4)
    bare = {p.describe(): p.step_time for p in _only(profile, 4)}
    for p in _only(profile, 4, calibration=Calibration(step=0.5)):
        assert p.step_time == pytest.approx(bare[p.describe()] + 0.5, rel=1e-12)


def test_measured_cores_apply_unless_the_plan_gives_its_own() -> None:
    profile = _profile(4, t=0.25)
    measured = _find(_only(profile, 4, calibration=Calibration(cores=1.5)), 1, 1)
    assert measured.step_time == pytest.approx(4 * 3.0 / 1.5, rel=1e-12)
    own = _find(_only(profile, 4, calibration=Calibration(cores=1.5), cores=4), 1, 1)
    assert own.step_time == pytest.approx(3.0, rel=1e-12)
    with pytest.raises(ValueError, match="Calibration.cores"):
        Calibration(cores=0.0)
