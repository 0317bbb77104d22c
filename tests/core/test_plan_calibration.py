"""The calibrated cost model against closed forms: per-action and per-message costs, the CPU bound, FSDP2's cost."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import stagewise as sw
from stagewise import build_schedule, simulate
from stagewise.partition import CheckpointCost, LayerCost, LayerProfile
from stagewise.passes import add_grad_sync
from stagewise.planning import Calibration, LayoutCost, Link, search
from stagewise.schedules import generate
from stagewise.simulation import CostModel, shared_makespan


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


def test_a_boundary_a_v_keeps_on_a_rank_costs_no_message() -> None:
    """ZB-V at pp=2 places stages 0 1 1 0: the turn-around between stages 1 and 2 stays on rank 1, so each stage
    posts one message per F and B (not 1 2 2 1 as a stage per rank would), as the calibrated replay charges an F
    (``with_overhead`` under the same placement; it charges a split W its own action, the planner a B's once)."""
    from stagewise.ir import boundary_crossings, v_placement
    from stagewise.planning.action_cost import with_overhead

    assert boundary_crossings(v_placement(2)) == (1, 1, 1, 1)
    assert boundary_crossings(v_placement(3)) == (1, 2, 1, 1, 2, 1)
    assert boundary_crossings((0, 1, 0, 1)) == (1, 2, 2, 1) and boundary_crossings((0, 0)) == (0, 0)
    profile = _profile(8)
    cal = Calibration(action=0.25, message=0.125)
    bare = _find(_only(profile, 2, schedules=["zb-v"]), 2, 4)
    got = _find(_only(profile, 2, schedules=["zb-v"], calibration=cal), 2, 4)
    assert bare.costs is not None and got.costs is not None and got.costs.num_stages == 4
    replayed = with_overhead(bare.costs, 0.25, 0.125, v_placement(2))
    for s in range(4):
        assert got.costs.forward[s] == pytest.approx(bare.costs.forward[s] + 0.25 + 0.125, rel=1e-12)
        assert got.costs.forward[s] == pytest.approx(replayed.forward[s], rel=1e-12)
        b_got = got.costs.backward_input[s] + got.costs.backward_weight[s]
        b_bare = bare.costs.backward_input[s] + bare.costs.backward_weight[s]
        assert b_got == pytest.approx(b_bare + 0.25 + 0.125, rel=1e-12)  # (the B's one message each way)


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
    # a pipeline of 4 ranks on 2 cores: the fill and drain leave a core idle, so the shared-core replay (6.75) is
    # above both the dedicated 1F1B (7 x 0.75) and the node's compute over its cores (4 x 4 x 0.75 / 2 = 6)
    piped = _find(_only(profile, 4, cores=2), 4, 4)
    uniform = CostModel.uniform(4, forward=0.25, backward_input=0.25, backward_weight=0.25, output_bytes=16.0)
    replay = shared_makespan(add_grad_sync(generate("1f1b", 4, 4, None)), uniform, [1.0] * 4, 2.0)
    assert replay == pytest.approx(6.75, rel=1e-12)
    assert piped.step_time == pytest.approx(replay, rel=1e-12) and piped.breakdown["shared_cores"] == piped.step_time
    assert piped.breakdown["simulated"] == pytest.approx(5.25) and piped.breakdown["cpu_bound"] == pytest.approx(6.0)
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


def test_fsdp2_hooks_cost_each_sharded_action_per_unit_and_no_layout_term_multiplies_them() -> None:
    """Measured hooks h per unit and micro-batch: a sharded stage's F and B each gain h/2 per layer with parameters
    (4 here), every micro-batch; an unsharded layout's do not. With the hooks measured, a layout's fit has no term
    per unit and micro-batch: four corners lying on a + b u + c m + d u m give d = 0, not the corners' cross term."""
    profile = _profile(4)
    hooks = Calibration(sharding_fixed=0.0, sharding_per_byte=0.0, sharding_group=4, sharding_hooks=0.5)
    plain = Calibration(sharding_fixed=0.0, sharding_per_byte=0.0, sharding_group=4)
    got, bare = (
        _find(_only(profile, 4, calibration=hooks), 1, 1, 4),
        _find(_only(profile, 4, calibration=plain), 1, 1, 4),
    )
    assert got.costs is not None and bare.costs is not None
    assert got.costs.forward[0] == pytest.approx(bare.costs.forward[0] + 4 * 0.25, rel=1e-12)
    assert got.costs.backward(0) == pytest.approx(bare.costs.backward(0) + 4 * 0.25, rel=1e-12)
    piped = _find(_only(profile, 4, calibration=hooks), 4, 4)
    assert piped.costs == _find(_only(profile, 4, calibration=plain), 4, 4).costs
    assert Calibration.from_json(hooks.to_json()) == hooks and hooks.hooks_for(1) == 0.0 == plain.hooks_for(4)
    corners = {(u, m): 1.0 + 0.5 * u + 0.25 * m + 0.125 * u * m for u in (1, 2) for m in (2, 6)}
    assert LayoutCost.fit(1, 1, 1, 4, corners).per_unit_microbatch == pytest.approx(0.125)
    flat = LayoutCost.fit(1, 1, 1, 4, corners, dict.fromkeys(corners, 0.0), cross=False)
    assert flat.per_unit_microbatch == 0.0 and flat.cpu[3] == 0.0
    with pytest.raises(ValueError, match="sharding_hooks"):
        Calibration(sharding_hooks=-1.0)


def test_the_calibrations_links_are_used_unless_the_plan_names_its_own() -> None:
    profile = _profile(4)
    cal = Calibration(intra=Link(1e-3, 1e9), inter=Link(2e-3, 1e8))
    got = _find(_only(profile, 4, calibration=cal), 4, 4)
    assert got.costs is not None and got.costs.latency == 1e-3
    own = _find(_only(profile, 4, calibration=cal, intra=Link(5e-3, 1e9)), 4, 4)
    assert own.costs is not None and own.costs.latency == 5e-3
    across = _find(_only(profile, 4, calibration=cal, nodes=4), 4, 4)  # one process per node: pp crosses nodes
    assert across.costs is not None and across.costs.latency == 2e-3


def test_a_pipeline_across_nodes_crosses_the_inter_link_only_where_its_ranks_do() -> None:
    """4 processes on 2 nodes, pp 4: boundaries 0-1 and 2-3 stay inside a node, 1-2 crosses. The planner prices
    1-2 at the inter link and the others at the intra link, as the simulator with those nodes does."""
    profile = _profile(4)
    intra, inter = Link(1e-3, math.inf), Link(0.5, math.inf)
    got = _find(_only(profile, 4, nodes=2, intra=intra, inter=inter), 4, 4)
    assert got.costs is not None and got.costs.rank_nodes == (0, 0, 1, 1)
    assert (got.costs.latency, got.costs.local_latency) == (0.5, 1e-3)
    plain = replace(got.costs, rank_nodes=(), local_latency=0.0)  # every boundary on the inter link
    schedule = build_schedule("1f1b", 4, 4)
    apart, alone = simulate(schedule, got.costs).makespan, simulate(schedule, plain).makespan
    # free links: (m + p - 1) (F + B) = 7 x 3 s; the critical path crosses the middle boundary 4 times and the two
    # inside the nodes 3 times each
    assert got.step_time == pytest.approx(apart) == 21 + 4 * 0.5 + 6 * 1e-3
    assert alone == pytest.approx(21 + 10 * 0.5)


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


def test_a_layout_cost_fit_recovers_its_terms_and_holds_slopes_at_zero() -> None:
    """Residuals made from known terms come back exactly; a corner set whose slopes read negative (noise) gets them at
    0 with the mean over the corners kept, so extrapolating to many layers and micro-batches cannot go below it."""
    true = LayoutCost(2, 2, 1, 1, 0.004, 0.001, 0.0005, 0.00025)
    corners = {(u, m): true.at(u, m) for u in (1, 2) for m in (2, 6)}
    got = LayoutCost.fit(2, 2, 1, 1, corners)
    for name in ("fixed", "per_unit", "per_microbatch", "per_unit_microbatch"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-9, abs=1e-15)
    noisy = {(1, 2): 0.010, (2, 2): 0.008, (1, 6): 0.009, (2, 6): 0.006}  # every slope negative
    flat = LayoutCost.fit(1, 4, 1, 1, noisy)
    assert (flat.per_unit, flat.per_microbatch, flat.per_unit_microbatch) == (0.0, 0.0, 0.0)
    assert flat.fixed == pytest.approx(0.00825, rel=1e-12) and flat.at(6, 32) == pytest.approx(0.00825, rel=1e-12)
    both = LayoutCost.fit(2, 2, 1, 1, noisy, cpu=corners)  # the cpu terms fit the same way, apart
    assert both.cpu == pytest.approx((0.004, 0.001, 0.0005, 0.00025), rel=1e-9, abs=1e-15)
    assert both.fixed == flat.fixed and both.cpu_at(3, 5) == pytest.approx(true.at(3, 5), rel=1e-12)
    assert LayoutCost(1, 1, 1, 1, -1.0).at(1, 1) == 0.0  # never below 0
    with pytest.raises(ValueError, match="2 x 2 corners"):
        LayoutCost.fit(1, 1, 1, 1, {(1, 2): 0.0, (2, 2): 0.0, (1, 6): 0.0})
    with pytest.raises(ValueError, match="ints >= 1"):
        LayoutCost(0, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="finite"):
        LayoutCost(1, 1, 1, 1, math.nan)
    with pytest.raises(ValueError, match="LayoutCost entries"):
        Calibration(layouts=((1, 1, 1, 1, 0.0),))  # type: ignore[arg-type]


def test_a_measured_layout_replaces_the_cost_per_step_for_that_layout_only() -> None:
    """A plan on a measured layout pays that layout's fitted cost at its units per rank and micro-batches (tp falls
    back to the tp = 1 row); every other layout pays ``step``."""
    cal = Calibration(step=0.5, layouts=(LayoutCost(2, 2, 1, 1, 0.25, 0.125, 0.0625, 0.03125),))
    assert cal.step_for(2, 2, 1, 1, 3, 4) == pytest.approx(0.25 + 0.125 * 3 + (0.0625 + 0.03125 * 3) * 4)
    assert cal.step_for(2, 2, 2, 1, 3, 4) == cal.step_for(2, 2, 1, 1, 3, 4)
    assert cal.step_for(4, 1, 1, 1, 3, 4) == 0.5
    profile = _profile(4)
    bare = {p.describe(): p for p in _only(profile, 4)}
    checked = 0
    for p in _only(profile, 4, calibration=cal):
        ref = bare[p.describe()]
        if (p.layout.pp, p.layout.dp) == (2, 2):
            units = max(p.partition)  # every layer has parameters; v = 1, so a rank holds one stage
            extra = cal.step_for(2, 2, 1, 1, units, p.microbatches)
            checked += 1
        else:
            extra = 0.5
        assert p.step_time == pytest.approx(ref.step_time + extra, rel=1e-12), p.describe()
    assert checked > 0
    assert cal.to_dict()["layouts"] == [
        {
            "pp": 2,
            "dp": 2,
            "tp": 1,
            "sharding": 1,
            "fixed": 0.25,
            "per_unit": 0.125,
            "per_microbatch": 0.0625,
            "per_unit_microbatch": 0.03125,
            "cpu": (0.0, 0.0, 0.0, 0.0),
        }
    ]


def test_a_layouts_hidden_cpu_is_charged_to_the_shared_cores_only() -> None:
    """A layout's ``cpu`` terms (CPU per process per step beyond its compute actions) add to every process's compute
    where processes outnumber the cores - in the CPU bound and, spread over each rank's actions, in the shared-core
    replay - and change nothing where each process has a core."""
    hidden = LayoutCost(4, 1, 1, 1, 0.0, cpu=(0.5, 0.25, 0.0, 0.0))  # 0.5 + 0.25 per layer with parameters
    cal = Calibration(layouts=(hidden,))
    assert cal.cpu_for(4, 1, 1, 1, 2, 4) == pytest.approx(1.0) and cal.cpu_for(2, 2, 1, 1, 2, 4) == 0.0
    assert cal.cpu_for(4, 1, 2, 1, 2, 4) == cal.cpu_for(4, 1, 1, 1, 2, 4)  # tp falls back to the tp = 1 row
    profile = _profile(4, t=0.25)
    # each of the 4 ranks holds one layer: 0.75 of hidden CPU beside its m (F + B) = 4 x 0.75 = 3 of compute
    assert _find(_only(profile, 4, calibration=cal), 4, 4).step_time == pytest.approx(5.25, rel=1e-12)  # own cores
    piped = _find(_only(profile, 4, calibration=cal, cores=2), 4, 4)
    assert piped.breakdown["hidden_cpu"] == pytest.approx(0.75)
    assert piped.breakdown["cpu_bound"] == pytest.approx(4 * (3.0 + 0.75) / 2, rel=1e-12)
    stretch = 1.25  # (3 + 0.75) / 3 on every rank
    uniform = CostModel.uniform(
        4, forward=0.25 * stretch, backward_input=0.25 * stretch, backward_weight=0.25 * stretch, output_bytes=16.0
    )
    replay = shared_makespan(add_grad_sync(generate("1f1b", 4, 4, None)), uniform, [1.0] * 4, 2.0)
    assert piped.breakdown["shared_cores"] == pytest.approx(replay, rel=1e-12)
    assert piped.step_time == pytest.approx(max(replay, 7.5), rel=1e-12) and replay > 6.75
    # a layout it was not measured on pays nothing
    assert _find(_only(profile, 4, calibration=cal, cores=2), 1, 1).step_time == pytest.approx(6.0, rel=1e-12)
    with pytest.raises(ValueError, match="LayoutCost.cpu"):
        LayoutCost(1, 1, 1, 1, 0.0, cpu=(0.0, math.inf, 0.0, 0.0))


def test_idle_transport_cpu_takes_its_share_of_the_shared_cores() -> None:
    """``background`` (CPU seconds per second each process spends idle) leaves ``cores - per_node * background``
    for the work when processes outnumber cores: dp=4 on 2 cores at 0.125 each computes 48 on 1.5 cores, not 2; with a
    core per process it changes nothing, and it never leaves less than a tenth of the cores."""
    profile = _profile(4, t=0.25)
    busy = _find(_only(profile, 4, calibration=Calibration(background=0.125), cores=2), 1, 1)
    assert busy.step_time == pytest.approx(4 * 3.0 / 1.5, rel=1e-12) and busy.breakdown["cpu_bound"] == busy.step_time
    piped = _find(_only(profile, 4, calibration=Calibration(background=0.125), cores=2), 4, 4)
    uniform = CostModel.uniform(4, forward=0.25, backward_input=0.25, backward_weight=0.25, output_bytes=16.0)
    assert piped.breakdown["shared_cores"] == pytest.approx(
        shared_makespan(add_grad_sync(generate("1f1b", 4, 4, None)), uniform, [1.0] * 4, 1.5), rel=1e-12
    )
    own = _find(_only(profile, 4, calibration=Calibration(background=0.125), cores=4), 1, 1)
    assert own.step_time == pytest.approx(3.0, rel=1e-12)
    floor = _find(_only(profile, 4, calibration=Calibration(background=10.0), cores=2), 1, 1)
    assert floor.step_time == pytest.approx(4 * 3.0 / 0.2, rel=1e-12)
    with pytest.raises(ValueError, match="Calibration.background"):
        Calibration(background=-0.1)


def test_a_recomputed_stage_pays_the_checkpoints_line_at_its_saved_tensors_whatever_the_micro_batch() -> None:
    """Under recompute a stage's F gains k_F (c_F + n p_F) and its backward the forward again plus k_B (c_B + n p_B),
    n the saved tensors of its layers (CheckpointCost); neither grows with the batch; without recompute, or with a
    profile that has no CheckpointCost (one written before it), nothing is added; the JSON form keeps both."""
    ck = CheckpointCost(segment_forward=0.5, segment_backward=0.75, per_saved_forward=0.125, per_saved_backward=0.25)
    base = _profile(4)
    saved = [3.0, 5.0, 7.0, 9.0]
    profile = replace(base, layers=tuple(replace(x, saved_tensors=n) for x, n in zip(base.layers, saved)))
    profile = replace(profile, checkpoint=ck)
    assert LayerProfile.from_json(profile.to_json()) == profile
    kw: dict = {"overhead": 0.5, "recompute": ("stage",)}
    for scale, (kf, kb) in ((None, (1.0, 1.0)), ((2.0, 3.0), (2.0, 3.0))):
        opts = {**kw, **({"compute_scale": scale} if scale else {})}
        for m in (1, 4):  # micro-batches of 4 and of 1 sample
            old = _find(_only(base, 4, **opts), 4, m)
            new = _find(_only(profile, 4, **opts), 4, m)
            assert old.costs is not None and new.costs is not None and new.recompute == "stage"
            for s, n in enumerate(saved):
                assert new.costs.forward[s] == pytest.approx(old.costs.forward[s] + kf * (0.5 + n * 0.125), rel=1e-12)
                want = old.costs.backward_input[s] + kb * (0.75 + n * 0.25)
                assert new.costs.backward_input[s] == pytest.approx(want, rel=1e-12)
            assert new.step_time > old.step_time
    off = {"recompute": (None,)}
    assert _find(_only(profile, 4, **off), 4, 4).costs == _find(_only(base, 4, **off), 4, 4).costs
    assert replace(profile, checkpoint=None).checkpoint is None
    legacy = _find(_only(replace(profile, checkpoint=None), 4, **kw), 4, 4)
    assert legacy.costs == _find(_only(base, 4, **kw), 4, 4).costs


def test_a_measured_compute_scale_multiplies_each_stages_forward_and_backward_only() -> None:
    """compute_scale=(kf, kb[, ks]): F = kf (sigma f + c), B = kb (sigma b + c), I = ks (sigma i + c/2),
    W = ks (sigma w + c/2), with c the fixed cost per action (overhead, action), ks = kb when not given; tp
    all-reduces are not compute and stay; a recomputed I is the scaled F + I + W; one number scales all; bad values
    name the option."""
    profile = _profile(4)
    cal = Calibration(action=0.25)
    kw: dict = {"calibration": cal, "overhead": 0.5}
    bare = _find(_only(profile, 4, **kw), 4, 4)
    got = _find(_only(profile, 4, compute_scale=(2.0, 3.0), **kw), 4, 4)
    assert bare.costs is not None and got.costs is not None
    for s in range(4):
        assert got.costs.forward[s] == pytest.approx(2.0 * bare.costs.forward[s], rel=1e-12)
        assert got.costs.backward_input[s] == pytest.approx(3.0 * bare.costs.backward_input[s], rel=1e-12)
        assert got.costs.backward_weight[s] == pytest.approx(3.0 * bare.costs.backward_weight[s], rel=1e-12)
        assert got.costs.backward(s) == pytest.approx(3.0 * bare.costs.backward(s), rel=1e-12)
    assert got.step_time > bare.step_time
    # a split backward (I and W apart) has a factor of its own; a fused one under the same options keeps kb
    zb = {"schedules": ["zb-h1"], **kw}
    split_bare = _find(_only(profile, 4, **zb), 4, 4)
    for scale, k in (((2.0, 3.0, 5.0), 5.0), ((2.0, 3.0), 3.0)):
        split = _find(_only(profile, 4, compute_scale=scale, **zb), 4, 4)
        assert split_bare.costs is not None and split.costs is not None and split.schedule == "zb-h1"
        assert split.costs.forward[1] == pytest.approx(2.0 * split_bare.costs.forward[1], rel=1e-12)
        assert split.costs.backward_input[1] == pytest.approx(k * split_bare.costs.backward_input[1], rel=1e-12)
        assert split.costs.backward_weight[1] == pytest.approx(k * split_bare.costs.backward_weight[1], rel=1e-12)
    fused = _find(_only(profile, 4, compute_scale=(2.0, 3.0, 5.0), **kw), 4, 4)  # 1F1B runs B: kb, not ks
    assert fused.costs is not None and fused.costs.backward_full == got.costs.backward_full
    assert fused.step_time == got.step_time
    same = _find(_only(profile, 4, compute_scale=1.5, **kw), 4, 4)
    assert same.costs is not None and same.costs.forward[1] == pytest.approx(1.5 * bare.costs.forward[1], rel=1e-12)
    assert same.costs.backward_input[1] == pytest.approx(1.5 * bare.costs.backward_input[1], rel=1e-12)
    # recompute: I runs the forward again and does W (the runtime's rule), each at its own factor
    rc = {"recompute": ("stage",)}
    plain = _find(_only(profile, 4, **rc, **kw), 4, 4)
    scaled = _find(_only(profile, 4, compute_scale=(2.0, 3.0), **rc, **kw), 4, 4)
    assert plain.costs is not None and scaled.costs is not None
    f, i_w = bare.costs.forward[2], bare.costs.backward_input[2] + bare.costs.backward_weight[2]
    assert plain.costs.backward_input[2] == pytest.approx(f + i_w, rel=1e-12)
    assert scaled.costs.backward_input[2] == pytest.approx(2.0 * f + 3.0 * i_w, rel=1e-12)
    assert scaled.costs.backward_weight[2] == 0.0
    # tp all-reduces are transfers, not compute: the same seconds with or without the scale
    tp = {"tp_layers": range(4), "schedules": ["1f1b"], "recompute": (None,), "top": 1000, "global_batch": 4}
    tp["intra"] = Link(latency=0.01, bandwidth=1e6)
    one = next(p for p in search(profile, 2, **tp).plans if p.layout.tp == 2)
    two = next(p for p in search(profile, 2, compute_scale=(2.0, 2.0), **tp).plans if p.describe() == one.describe())
    assert one.costs is not None and two.costs is not None and one.breakdown["tp_comm"] > 0
    assert two.breakdown["tp_comm"] == pytest.approx(one.breakdown["tp_comm"], rel=1e-12)
    tp_fwd = one.breakdown["tp_comm"] / one.microbatches / 2  # per forward: half of a micro-batch's all-reduces
    assert two.costs.forward[0] == pytest.approx(2.0 * (one.costs.forward[0] - tp_fwd) + tp_fwd, rel=1e-12)
    for bad in (0.0, -1.0, math.inf, math.nan, (1.0,), (1.0, 2.0, 3.0, 4.0), (1.0, 0.0), (1.0, 1.0, -1.0), True):
        with pytest.raises(ValueError, match="compute_scale"):
            search(profile, 2, global_batch=2, compute_scale=bad)  # type: ignore[arg-type]
