"""schedule="auto" picks, by the simulator, between a schedule synthesized for one stage per rank and one for two
(V placement), each under 1F1B's memory (min(p, m) micro-batches in flight per rank)."""

from __future__ import annotations

from torch import nn

import stagewise as sw
from stagewise.partition import LayerCost, LayerProfile
from stagewise.runtime.assembly.auto_schedule import _fastest
from stagewise.schedules import generate


def _profile(n: int, head: float = 1.0) -> LayerProfile:
    layers = [LayerCost(str(k), 1.0, 1.0, 1.0, 2.0, 100.0, 60.0, 8.0, 10.0) for k in range(n - 1)]
    layers.append(LayerCost("head", head, head, head, 2 * head, 100.0, 60.0, 8.0, 10.0))
    return LayerProfile(layers, "synthetic", 1, 0)


def _named(n: int) -> list[tuple[str, nn.Module]]:
    return [(str(k), nn.Identity()) for k in range(n)]


def test_two_stages_per_rank_win_when_they_are_faster_and_both_keep_1f1bs_memory() -> None:
    prof, p, m = _profile(8), 2, 4
    schedule, counts = _fastest(prof, p, m, [1, 2], "time", _named(8))
    assert schedule.virtual_stages == 2 and sum(counts) == 8 and len(counts) == 4
    one_cut = prof.cost_model([0, 4, 8])
    two_cut = prof.cost_model([0, *[sum(counts[:k]) for k in range(1, 5)]])
    sim = sw.simulate(schedule, two_cut)
    assert max(sim.peak_activations) <= min(p, m)
    zbv = sw.simulate(generate("zb-v", p, m, 2), two_cut)
    assert sim.makespan <= zbv.makespan
    loop, _ = _fastest(prof, p, m, [1], "time", _named(8))
    assert loop.virtual_stages == 1
    assert sim.makespan < sw.simulate(loop, one_cut).makespan


def test_one_stage_per_rank_when_the_layers_are_too_few_for_two() -> None:
    schedule, counts = _fastest(_profile(3), 2, 4, [1, 2], "time", _named(3))
    assert schedule.virtual_stages == 1 and len(counts) == 2
