"""The planner against references: brute force over its space, closed forms, heterogeneous partitions, bad input."""

from __future__ import annotations

import itertools
import math
import re

import pytest

import stagewise as sw
from helpers.examples import DEEP
from stagewise.partition import LayerCost, LayerProfile
from stagewise.planning import Link, crosses_nodes, ring_all_reduce, ring_reduce_scatter, search, transformer_profile
from stagewise.schedules import generate, schedule_info, schedule_names
from stagewise.simulation import CostModel

GIB = 2**30


def _profile(times: list[float], *, act: float = 64.0, params: float = 1024.0, out: float = 16.0) -> LayerProfile:
    """Layers with forward t, I = W = t (B = 2t), ``act`` activation bytes, ``params`` parameter bytes (one sample)."""
    layers = tuple(LayerCost(f"l{k}", t, t, t, 2 * t, act, act / 2, params, out) for k, t in enumerate(times))
    return LayerProfile(layers, "synthetic", 1, 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _all_bounds(n: int, p: int) -> list[tuple[int, ...]]:
    return [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), p - 1)]


def _stage_time(profile: LayerProfile, bounds: tuple[int, ...]) -> list[float]:
    return [sum(x.forward + x.backward for x in profile.layers[a:b]) for a, b in zip(bounds, bounds[1:])]


# ---- 1. the search finds the brute-force optimum -----------------------------------


def _brute_force(profile: LayerProfile, processes: int, global_batch: int) -> tuple[float, str]:
    """Every layout, synchronous schedule (v up to 2), micro-batch count and min-max partition, simulated here.

    Free links, so the step is the simulated makespan; the partition is the best min-max cut found by
    trying every cut (ties broken towards earlier stages, as the partitioner does).
    """
    best = (math.inf, "")
    n = len(profile)
    for pp in _divisors(processes):
        if pp > n:
            continue
        replicas = processes // pp
        if global_batch % replicas:
            continue
        per_replica = global_batch // replicas
        names = ["1f1b"] if pp == 1 else [x for x in schedule_names() if schedule_info(x).synchronous]
        for name in names:
            info = schedule_info(name)
            vs = [2] if info.virtual_stages is None else list(info.virtual_stages)
            for v in vs:
                if pp * v > n:
                    continue
                bounds = min(_all_bounds(n, pp * v), key=lambda b: max(_stage_time(profile, b)))
                for m in _divisors(per_replica):
                    try:
                        schedule = generate(name, pp, m, v)
                    except ValueError:
                        continue
                    scale = per_replica // m
                    c = profile.cost_model(bounds)
                    costs = CostModel(
                        num_stages=c.num_stages,
                        forward=[x * scale for x in c.forward],
                        backward_input=[x * scale for x in c.backward_input],
                        backward_weight=[x * scale for x in c.backward_weight],
                        activation_bytes=c.activation_bytes,
                        weight_activation_bytes=c.weight_activation_bytes,
                        parameter_bytes=c.parameter_bytes,
                        output_bytes=c.output_bytes,
                    )
                    step = sw.simulate(schedule, costs).makespan
                    best = min(best, (step, f"{name} pp={pp} v={v} m={m}"))
    return best


@pytest.mark.parametrize(
    "times",
    [
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [0.5, 2.0, 1.0, 1.0, 1.0, 3.0],
        [4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.25],
    ],
)
def test_the_search_finds_the_brute_force_optimum(times: list[float]) -> None:
    profile = _profile(times)
    expected, what = _brute_force(profile, 4, 8)
    found = search(profile, 4, global_batch=8, recompute=(None,), max_virtual_stages=2, top=3)
    assert found.plans[0].step_time == pytest.approx(expected, rel=1e-12), (found.plans[0].describe(), what)
    assert found.simulated < found.candidates  # the bounds pruned something
    steps = [p.step_time for p in found.plans]
    assert steps == sorted(steps)


# ---- 2. heterogeneity ------------------------------------------------------------------


def test_slow_and_small_ranks_get_less_work_and_the_partition_is_the_brute_force_one() -> None:
    times = [1.0, 2.0, 1.0, 1.5, 1.0, 1.0, 0.5, 2.0]
    profile = _profile(times, params=1 * GIB)
    # parameters + gradients + AdamW state = 4 GiB per layer; 30 GiB cannot hold all 8 layers (32 GiB)
    speeds = [1.0, 0.5]
    memory = [30 * GIB, 14 * GIB]  # the slow rank is also small: at most 3 layers
    plans = sw.plan(profile, 2, global_batch=4, speeds=speeds, memory=memory, recompute=(None,), schedules=["1f1b"])
    best = plans[0]
    assert best.layout.pp == 2  # one rank cannot hold the model
    counts = best.partition

    def feasible(b: tuple[int, ...]) -> bool:
        return all(4 * GIB * (hi - lo) + 1e6 <= cap for lo, hi, cap in zip(b, b[1:], memory))

    def bottleneck(b: tuple[int, ...]) -> float:
        return max(t / s for t, s in zip(_stage_time(profile, b), speeds))

    brute = min((b for b in _all_bounds(len(times), 2) if feasible(b)), key=bottleneck)
    assert counts == tuple(hi - lo for lo, hi in zip(brute, brute[1:]))
    assert counts[1] < counts[0]
    assert best.memory[1].total <= memory[1]


# ---- 3. published relations, from the simulator alone ---------------------------------


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 16)])
def test_megatron_interleaving_divides_the_bubble_by_v(p: int, m: int) -> None:
    """Narayanan et al. 2021, Sec. 2.2.2: the bubble time (p-1)(F+B) of 1F1B becomes (p-1)(F+B)/v."""
    work = m * (1.0 + 2.0)  # per rank: F = 1, B = I + W = 2 per micro-batch
    plain = sw.simulate(generate("1f1b", p, m), CostModel.uniform(p)).makespan
    assert plain - work == (p - 1) * 3.0
    for v in (2, 4):
        costs = CostModel.uniform(p * v, forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
        span = sw.simulate(generate("interleaved-1f1b", p, m, v), costs).makespan
        assert span - work == (p - 1) * 3.0 / v


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (6, 12)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_f_i_w(p: int, m: int) -> None:
    """Qi et al. 2024, Sec. 2.1: at F = I = W, ZB-H1's bubble is (p-1)F against 1F1B's (p-1)(F+B) = 3(p-1)F."""
    work = 3.0 * m
    one = sw.simulate(generate("1f1b", p, m), CostModel.uniform(p)).makespan - work
    zb = sw.simulate(generate("zb-h1", p, m), CostModel.uniform(p)).makespan - work
    assert zb * 3 == one == 3.0 * (p - 1)


@pytest.mark.parametrize("b", [1.0, 2.0, 3.0])
def test_each_schedule_is_charged_its_own_backward(b: float) -> None:
    """Layers measured at F = I = W = 1 and B = b: a 1F1B plan runs B (step (m + p - 1)(1 + b), compute m(1 + b)
    per rank), a ZB-H1 plan runs I and W (step 3m + p - 1 whatever B costs), so the ranking follows B: with B below
    I + W by more than ZB-H1's smaller bubble is worth, 1F1B wins."""
    p, m = 4, 8
    layers = tuple(LayerCost(f"l{k}", 1.0, 1.0, 1.0, b, 64.0, 32.0, 1024.0, 16.0) for k in range(p))
    profile = LayerProfile(layers, "synthetic", 1, 0)
    plans = search(profile, p, global_batch=m, schedules=["1f1b", "zb-h1"], recompute=(None,), top=100).plans
    mine = {x.schedule: x for x in plans if x.layout.pp == p and x.microbatches == m}
    one, zb = mine["1f1b"], mine["zb-h1"]
    assert one.costs is not None and one.costs.backward_full == (b,) * p
    assert one.breakdown["simulated"] == (m + p - 1) * (1.0 + b) and one.breakdown["compute"] == m * (1.0 + b)
    assert zb.breakdown["simulated"] == 3 * m + p - 1 and zb.breakdown["compute"] == 3 * m
    assert (one.step_time < zb.step_time) == ((m + p - 1) * (1.0 + b) < 3 * m + p - 1)


# ---- the cost pieces --------------------------------------------------------------------


def test_ring_costs_and_node_crossing() -> None:
    link = Link(latency=1.0, bandwidth=4.0)
    assert ring_all_reduce(16.0, 4, link) == 2 * 3 * (1.0 + 16.0 / 16.0)
    assert ring_reduce_scatter(16.0, 4, link) == 3 * (1.0 + 1.0)
    assert ring_all_reduce(16.0, 1, link) == 0.0
    config = sw.ParallelConfig(pp=2, dp=2, tp=2)  # tp pairs (0,1), dp pairs (0,2), pp pairs (0,4)
    assert not crosses_nodes(config, "tp", 2) and crosses_nodes(config, "dp", 2) and crosses_nodes(config, "pp", 2)
    assert not crosses_nodes(config, "dp", 4) and crosses_nodes(config, "pp", 4)


def test_plans_memory_matches_the_simulator_and_sync_adds_ring_time() -> None:
    profile = _profile([1.0, 2.0, 1.0, 1.0, 2.0, 1.0], act=100.0, params=1000.0)
    link = Link(latency=0.5, bandwidth=100.0)
    found = search(profile, 4, global_batch=8, intra=link, top=8, recompute=(None,))
    for p in found.plans:
        bounds = [0, *itertools.accumulate(p.partition)]
        sched = generate(p.schedule, p.layout.pp, p.microbatches, p.virtual_stages)
        c = profile.cost_model(bounds, latency=link.latency, bandwidth=link.bandwidth)
        scale = p.microbatch_size
        costs = CostModel(
            num_stages=c.num_stages,
            forward=[x * scale for x in c.forward],
            backward_input=[x * scale for x in c.backward_input],
            backward_weight=[x * scale for x in c.backward_weight],
            activation_bytes=[x * scale for x in c.activation_bytes],
            weight_activation_bytes=[x * scale for x in c.weight_activation_bytes],
            parameter_bytes=c.parameter_bytes,
            output_bytes=[x * scale for x in c.output_bytes],
            latency=link.latency,
            bandwidth=link.bandwidth,
        )
        sim = sw.simulate(sched, costs)
        assert [m.activations for m in p.memory] == pytest.approx(sim.peak_activation_bytes, rel=1e-12)
        for r, mem in enumerate(p.memory):
            held = sum(costs.parameter_bytes[s] for s in sched.stages_of(r))
            assert mem.parameters == mem.gradients == held
            assert mem.optimizer == pytest.approx(2 * held / p.layout.sharding)
        # the gradient sync can only lengthen the step; an exposed all-reduce at most adds its ring time
        assert p.step_time >= sim.makespan - 1e-12
        worst = max(
            ring_all_reduce(sum(costs.parameter_bytes[s] for s in sched.stages_of(r)), p.layout.dp, link)
            for r in range(p.layout.pp)
        )
        if p.layout.sharding == 1:
            assert p.step_time <= sim.makespan + p.layout.pp * p.virtual_stages * worst + 1e-9


def test_tensor_parallel_layers_run_faster_and_pay_all_reduces() -> None:
    profile = _profile([4.0] * 4, out=8.0)
    link = Link(latency=0.25, bandwidth=8.0)
    plans = sw.plan(profile, 2, global_batch=1, tp_layers=range(4), intra=link, recompute=(None,), top=20)
    tp2 = [p for p in plans if p.layout.tp == 2]
    assert tp2, [p.describe() for p in plans]
    # one micro-batch of one sample on tp=2: each layer F = 2 + 2 all-reduces of 8 bytes, B = 4 + the same
    ar = ring_all_reduce(8.0, 2, link)
    assert ar == 2 * (0.25 + 8.0 / 16.0)
    assert tp2[0].step_time == pytest.approx(4 * (2.0 + 2 * ar) + 4 * (4.0 + 2 * ar))
    assert tp2[0].breakdown["tp_comm"] == pytest.approx(4 * 4 * ar)


# ---- 4. bad input -------------------------------------------------------------------------


def test_a_memory_cap_no_plan_fits_names_the_smallest_peak_and_its_term() -> None:
    profile = _profile([1.0] * 4, params=1 * GIB, act=1.0)
    with pytest.raises(ValueError, match=r"no plan fits the memory cap: the smallest predicted peak is 6 GiB") as err:
        sw.plan(profile, 4, global_batch=4, memory=5 * GIB, optimizer_state=4.0)
    assert "its largest term is optimizer state" in str(err.value)
    act_heavy = _profile([1.0] * 4, params=1.0, act=GIB)
    with pytest.raises(ValueError, match="its largest term is activations"):
        sw.plan(act_heavy, 2, global_batch=64, memory=0.5 * GIB, recompute=(None,))


def test_no_valid_factorisation_says_so() -> None:
    with pytest.raises(ValueError, match=r"no factorisation pp x dp x sharding x tp of 7 processes works: .*pp=7"):
        sw.plan(_profile([1.0] * 4), 7, global_batch=4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"global_batch": 0}, "global_batch must be a positive int"),
        ({"global_batch": 4, "memory": [1.0]}, "memory has 1 entries, expected one per process (2)"),
        ({"global_batch": 4, "schedules": ["nope"]}, "unknown schedule 'nope'"),
        ({"global_batch": 4, "tp_layers": ["x"]}, "tp_layers names 'x'"),
        ({"global_batch": 4, "nodes": 3}, "nodes must be a positive int dividing processes (2)"),
    ],
)
def test_bad_arguments_name_the_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        sw.plan(_profile([1.0] * 4), 2, **kwargs)


# ---- 5. scale ----------------------------------------------------------------------------


@pytest.mark.skipif(not DEEP, reason="the planner's scale check runs in make test-deep (~10 s of one core)")
def test_planning_4096_processes_over_512_nodes_returns_a_plan() -> None:
    """The scale target (timed in benchmarks/plan_scale.py, not here); `make test-deep` runs it."""
    profile = transformer_profile()
    found = search(
        profile,
        4096,
        nodes=512,
        global_batch=2048,
        memory=80 * GIB,
        intra=Link(5e-6, 300e9),
        inter=Link(2e-5, 25e9),
        tp_layers=range(1, 129),
        top=3,
    )
    best = found.plans[0]
    assert best.layout.world_size == 4096
    assert best.peak_memory <= 80 * GIB
    assert sum(best.partition) == 130
    assert found.simulated < found.candidates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pruning_never_loses_the_best_plan(seed: int) -> None:
    """With top larger than the space nothing is pruned: the best plan must be the one the pruned search found."""
    import random

    rng = random.Random(seed)
    profile = _profile([rng.choice([0.25, 0.5, 1.0, 2.0]) for _ in range(7)], act=rng.choice([10.0, 1000.0]))
    kwargs = dict(global_batch=8, intra=Link(0.05, 1e4), memory=rng.choice([math.inf, 1e5]), overhead=0.01)
    pruned = search(profile, 4, top=2, **kwargs)
    every = search(profile, 4, top=100_000, **kwargs)
    assert every.simulated > pruned.simulated
    assert pruned.plans[0].step_time == every.plans[0].step_time
    assert pruned.plans[1].step_time == every.plans[1].step_time


def test_fixed_costs_do_not_scale_with_the_micro_batch() -> None:
    """One process, 4 layers of F = 1, B = 2 per sample: a micro-batch of b samples costs 4b + 4o + a forward
    and 8b + 4o + a backward (o per layer, a per action)."""
    profile = _profile([1.0] * 4)
    plans = search(profile, 1, global_batch=4, overhead=0.25, action_overhead=0.5, recompute=(None,), top=3).plans
    for p in plans:
        b, m = p.microbatch_size, p.microbatches
        assert p.step_time == pytest.approx(m * ((4 * b + 4 * 0.25 + 0.5) + (8 * b + 4 * 0.25 + 0.5)))
    assert plans[0].microbatches == 1  # fixed costs favour fewer, larger micro-batches


def test_infeasible_candidates_are_dropped_with_their_reason() -> None:
    profile = _profile([1.0] * 4, params=GIB, act=1.0)  # 4 GiB per layer with AdamW: 16 GiB in all
    found = search(profile, 2, global_batch=2, memory=9 * GIB, recompute=(None,), top=50)
    assert all(p.layout.pp == 2 and p.peak_memory <= 9 * GIB for p in found.plans)
    one_stage = [d for d in found.dropped if d.what.startswith("pp=1 dp=2")]
    assert one_stage and "needs 16 GiB > its memory 9 GiB" in one_stage[0].reason
    assert "optimizer state dominate" in one_stage[0].reason  # 8 GiB of AdamW state, 4 of parameters, 4 of grads


def test_a_rank_short_of_memory_for_activations_gets_fewer_layers() -> None:
    """Activations dominate and rank 1 is small: the time-balanced cut (4, 4) overflows it, so the planner
    cuts again counting activations; the result matches the brute-force fastest cut that fits."""
    profile = _profile([1.0] * 8, act=100.0, params=1.0)
    memory = [10_000.0, 250.0]
    plans = sw.plan(profile, 2, global_batch=1, memory=memory, recompute=(None,), schedules=["1f1b"])
    best = plans[0]
    assert best.partition[1] < 4 and best.memory[1].total <= 250.0
    # brute force over cuts: 1F1B with one micro-batch holds one stage's activations per rank
    fits = [b for b in _all_bounds(8, 2) if (b[2] - b[1]) * (100.0 + 4.0) <= 250.0]
    fastest = min(fits, key=lambda b: max(_stage_time(profile, b)))
    assert best.partition == tuple(hi - lo for lo, hi in zip(fastest, fastest[1:]))


def test_a_value_two_layers_of_one_stage_both_save_is_charged_once() -> None:
    """Layer 1 saves its output, layer 2 the same tensor as its input (96 bytes): a stage of both holds it once,
    in the cost model and in the planner's stage sums alike; cut between them, each stage holds its copy."""
    from stagewise.planning.costing import layer_arrays, stage_base

    def layer(name: str, act: float, into: float, out: float) -> LayerCost:
        return LayerCost(name, 1.0, 0.5, 0.5, 1.0, act, 0.0, 8.0, 96.0, input_saved_bytes=into, output_saved_bytes=out)

    profile = LayerProfile([layer("a", 64.0, 0.0, 96.0), layer("b", 96.0, 96.0, 0.0)], "synthetic", 1, 0)
    assert profile.cost_model([0, 2]).activation_bytes == (64.0,)
    assert profile.cost_model([0, 1, 2]).activation_bytes == (64.0, 96.0)
    arrays = layer_arrays(profile, 1, frozenset())
    link = Link(latency=0.0, bandwidth=math.inf)
    one = stage_base(arrays, [0, 2], tp=1, tp_link=link, recompute=None, overhead=[0.0, 0.0])
    two = stage_base(arrays, [0, 1, 2], tp=1, tp_link=link, recompute=None, overhead=[0.0, 0.0])
    assert one.activation == (64.0,) and two.activation == (64.0, 96.0)


def test_a_swapped_link_pair_is_refused_by_what_it_reads_as() -> None:
    """``intra=(2.5e10, 5e-6)`` (bandwidth first) was taken as a 2.5e10 s latency: the top plan predicted a
    2e9-second step, without a word."""
    profile = _profile([1.0] * 4)
    with pytest.raises(ValueError, match=r"intra=\(25000000000.0, 5e-06\) reads as 2.5e\+10 s of latency .* swapped"):
        sw.plan(profile, 2, global_batch=4, intra=(2.5e10, 5e-6))
    assert sw.plan(profile, 2, global_batch=4, intra=(5e-6, 2.5e10), top=1)
