"""The default cut (``partition="balanced"``): costs estimated from counted work, a cut that pays for the
schedule it runs where the even cut loses, the even cut kept where it is as good, and the word when the named
schedule is predicted slower than 1F1B (issue 49 item 1)."""

from __future__ import annotations

import pytest

from stagewise import build_schedule, simulate
from stagewise.partition import (
    CountedLayer,
    Rates,
    balanced_counts,
    estimated_profile,
    parameters_as_work,
    stage_counts,
    uniform_counts,
)
from stagewise.partition.estimate import rank_loads
from stagewise.planning.defaults import NOISE, against_1f1b, pricing, refined_counts

RATES = Rates(flops=1e9, bytes=1e9, per_op=0.0)  # binary-friendly: a FLOP or a byte is a nanosecond


def layer(name: str, flops: float, *, params: float = 1.0, out: float = 0.0) -> CountedLayer:
    return CountedLayer(name, flops, 2 * flops, 0.0, 0.0, 0, 0, params, 4 * params, out)


def gpt_like(blocks: int, block: float = 1e6, tiny: float = 1e3, head: float = 2e5) -> list[CountedLayer]:
    """An embedding, positions, equal blocks, a norm and a head: what the issue's GPT looks like to a count."""
    return [
        layer("tokens", tiny),
        layer("positions", tiny, params=0.0),
        *(layer(f"block{k}", block) for k in range(blocks)),
        layer("ln_f", tiny),
        layer("head", head, params=0.0, out=1e4),
    ]


def makespan(profile, schedule, counts) -> float:
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return simulate(schedule, profile.cost_model(bounds)).makespan


def test_the_estimate_is_the_roofline_sum_and_charges_the_loss_to_the_last_layer() -> None:
    rates = Rates(flops=2.0, bytes=4.0, per_op=0.5)
    counted = [
        CountedLayer("a", 8.0, 16.0, 4.0, 8.0, 2, 4, 3.0, 12.0, 0.0),
        CountedLayer("b", 0, 0, 0, 0, 1, 1, 0, 0, 8),
    ]
    profile = estimated_profile(counted, rates, loss_passes=5.0)
    a, b = profile.layers
    assert (a.forward, a.backward) == (8 / 2 + 4 / 4 + 2 * 0.5, 16 / 2 + 8 / 4 + 4 * 0.5)
    assert a.backward_input == a.backward_weight == a.backward / 2  # parameters: I and W share B
    assert b.backward_weight == 0.0 and b.backward_input == b.backward  # none: no W
    assert (b.forward, b.backward) == (0.5 + 5 * 0.4 * 8 / 4, 0.5 + 5 * 0.6 * 8 / 4)


def test_zb_v_by_default_beats_the_even_cut_where_the_even_cut_loses() -> None:
    """The issue's case: 12 layers (8 blocks and four light ones) over zb-v's 4 stages on 2 ranks. The even cut
    [3, 3, 3, 3] puts 6 blocks on rank 1 and 2 on rank 0 (with the light layers); the default balances the
    ranks, and the simulator times zb-v well below the even cut's step."""
    profile = estimated_profile(gpt_like(8), RATES)
    zbv = build_schedule("zb-v", 2, 8, 2)
    times = profile.times()
    counts = refined_counts(profile, zbv, balanced_counts(times, 4, placement=zbv.placement))
    even = uniform_counts(12, 4)
    loads = rank_loads(counts, times, zbv.placement)
    assert max(loads) / min(loads) < 1.2, (counts, loads)
    assert max(rank_loads(even, times, zbv.placement)) / min(rank_loads(even, times, zbv.placement)) > 2.5
    assert makespan(profile, zbv, counts) < 0.85 * makespan(profile, zbv, even)


def test_refinement_balances_the_ranks_where_the_min_max_cut_only_balances_stages() -> None:
    """6 blocks over zb-v's 4 stages: every min-max cut of the stages has a 2-block stage, and the tie-break
    leaves rank 1 with 4 blocks; the boundary moves find the 3 + 3 split the V can run."""
    profile = estimated_profile(gpt_like(6, head=1e3), RATES)
    zbv = build_schedule("zb-v", 2, 8, 2)
    start = balanced_counts(profile.times(), 4, placement=zbv.placement)
    refined = refined_counts(profile, zbv, start)
    assert (_blocks_on(zbv, refined, 0), _blocks_on(zbv, refined, 1)) == (3, 3), refined
    assert makespan(profile, zbv, refined) < makespan(profile, zbv, start) * (1 - 0.005)


def _blocks_on(schedule, counts, rank: int) -> int:
    """How many of layers 2..7 (the blocks of ``gpt_like(6)``) rank ``rank`` holds under ``counts``."""
    held = [
        k for s, r in enumerate(schedule.placement) if r == rank for k in range(sum(counts[:s]), sum(counts[: s + 1]))
    ]
    return sum(1 for k in held if 2 <= k < 8)


@pytest.mark.parametrize("name, v", [("1f1b", None), ("zb-h1", None), ("interleaved-1f1b", 2), ("zb-v", 2)])
def test_equal_layers_keep_the_even_cut(name: str, v: int | None) -> None:
    profile = estimated_profile([layer(f"l{k}", 1e6) for k in range(10)], RATES)
    schedule = build_schedule(name, 2, 4, v)
    n = schedule.num_stages
    counts = balanced_counts(profile.times(), n, placement=schedule.placement)
    assert refined_counts(profile, schedule, counts) == counts == uniform_counts(10, n)


def test_balanced_mode_falls_back_to_parameters_then_to_the_even_cut() -> None:
    assert stage_counts(4, 2, "balanced") == [2, 2]
    assert stage_counts(4, 2, "balanced", parameters=lambda: [1.0, 1.0, 1.0, 9.0]) == [3, 1]
    assert stage_counts(4, 2, "balanced", parameters=lambda: [0.0] * 4) == [2, 2]  # nothing counted
    assert stage_counts(4, 2, "balanced", times=[5.0, 1.0, 1.0, 1.0]) == [1, 3]
    assert stage_counts(4, 2, "balanced", times=[1.0] * 4, speeds=[1.0, 3.0]) == [1, 3]  # speeds divide
    with pytest.raises(ValueError, match="costs has 3 entries, expected one per layer"):
        stage_counts(4, 2, "balanced", times=[1.0] * 3)


def test_the_word_says_when_the_named_schedule_is_predicted_slower_than_1f1b() -> None:
    """A V over layers whose transfers dwarf their compute is slower than 1F1B by the simulator (its V sends
    twice as many messages per micro-batch); on the GPT-like layers it is faster: no word."""
    zbv = build_schedule("zb-v", 2, 8, 2)
    slow_profile = estimated_profile([layer(f"l{k}", 1e3, out=1e6) for k in range(8)], RATES)
    slow = against_1f1b(slow_profile, zbv, [2, 2, 2, 2], latency=1e-3, bandwidth=1e9)
    fast = against_1f1b(estimated_profile(gpt_like(8), RATES), zbv, [4, 2, 2, 4])
    assert fast is not None and not fast.slower and fast.ratio < 1
    assert slow is not None and slow.slower and slow.ratio > 1 + NOISE
    line = slow.line()
    assert "'zb-v' is predicted" in line and f"{slow.ratio:.2f}x" in line
    assert f"{slow.predicted * 1e3:.2f} ms against {slow.one_f_one_b * 1e3:.2f} ms" in line
    assert against_1f1b(slow_profile, build_schedule("1f1b", 2, 8), [4, 4]) is None  # 1F1B against itself


#: a ResNet of 9 layers on 8 x 8 images (the fidelity benchmark's): stem, six basic blocks (16, 16, 32, 32, 64, 64
#: channels; strides halve each side twice), pooling, classifier: parameters and output positions per layer
RESNET_PARAMETERS = [144, 4608, 4608, 14336, 18432, 57344, 73728, 0, 650]
RESNET_POSITIONS = [64, 64, 64, 16, 16, 4, 4, 1, 1]


def test_without_inputs_convolutions_are_cut_evenly_where_parameters_would_lose() -> None:
    """A convolution's work is its parameters times its output positions: the ResNet's blocks do about equal
    work while their parameters grow 16-fold, so the cut by parameters (the old default without sample inputs)
    puts six of nine layers, nearly all the work, on rank 0. Without an input the positions are unknown: the
    default is the even cut, and on the true work 1F1B runs it faster than the parameters' cut."""
    work = [p * n for p, n in zip(RESNET_PARAMETERS, RESNET_POSITIONS)]
    true = estimated_profile([layer(f"l{k}", w) for k, w in enumerate(work)], RATES)
    one_f_one_b = build_schedule("1f1b", 2, 8)
    old = stage_counts(9, 2, "balanced", times=[float(p) for p in RESNET_PARAMETERS])
    new = stage_counts(9, 2, "balanced", times=parameters_as_work(RESNET_PARAMETERS, [True] * 7 + [False] * 2))
    assert old == [6, 3] and new == uniform_counts(9, 2) == [5, 4]
    assert makespan(true, one_f_one_b, new) < 0.85 * makespan(true, one_f_one_b, old)


def test_without_convolutions_parameters_stand_for_work() -> None:
    assert parameters_as_work([1, 3, 0], [False] * 3) == [1.0, 3.0, 0.0]
    assert parameters_as_work([1, 3, 0], [False, True, False]) == [0.0] * 3
    with pytest.raises(ValueError, match="3 parameter counts and 2 flags"):
        parameters_as_work([1, 3, 0], [False, False])


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v", "interleaved-1f1b"])
def test_the_first_batch_counted_work_cuts_a_resnet_v_better_than_evenly(name: str) -> None:
    """What the default does at the first batch when it had to cut a convolution evenly: the counted work
    (here the ResNet's true work, parameters x positions) cut for the placement and refined for the schedule
    runs the V and interleaved schedules faster than the even cut [3, 2, 2, 2] by more than the noise (the
    quiet run measured the even cut 1.10-1.21x the best cut on those rows)."""
    work = [p * n for p, n in zip(RESNET_PARAMETERS, RESNET_POSITIONS)]
    true = estimated_profile([layer(f"l{k}", w) for k, w in enumerate(work)], RATES)
    schedule = build_schedule(name, 2, 8, 2)
    cut = stage_counts(9, 4, "balanced", times=true.times(), placement=schedule.placement)
    decided = refined_counts(true, schedule, cut)
    even = uniform_counts(9, 4)
    assert decided != even and sum(decided) == 9
    assert makespan(true, schedule, decided) < (1 - 2 * NOISE) * makespan(true, schedule, even)


def test_the_word_prices_the_runtime_s_work_per_action() -> None:
    """Twelve small layers: on compute alone ZB-V's bubble-free order beats 1F1B (0.90x), but a V runs twice
    the actions of 1F1B on the same layers (two stages per rank, I and W apart), and at 0.1 ms per action (what
    the runtime costs on a CPU, :data:`~stagewise.partition.estimate.LINKS`) it loses: the word the MLP's V
    (measured 1.27x 1F1B without a word) should have had. Every added second is an action's: zero changes
    nothing."""
    tiny = estimated_profile([layer(f"l{k}", 2e4, out=1e3) for k in range(12)], RATES)
    zbv = build_schedule("zb-v", 2, 8, 2)
    bare = against_1f1b(tiny, zbv, [3, 3, 3, 3])
    priced = against_1f1b(tiny, zbv, [3, 3, 3, 3], per_action=1e-4)
    assert bare is not None and priced is not None and not bare.slower and bare.ratio < 0.95
    assert priced.slower and priced.ratio > 1.2
    assert against_1f1b(tiny, zbv, [3, 3, 3, 3], per_action=0.0) == bare
    # 1F1B's step on 2 ranks and 8 micro-batches runs 16 actions per rank in a chain of m + p - 1 = 9 F/B pairs
    # along the critical path: each 0.1 ms per action adds at least 2 x 9 of them
    assert priced.one_f_one_b >= bare.one_f_one_b + 18 * 1e-4 - 1e-12


def test_the_default_times_convolutions_and_counts_the_rest() -> None:
    """A convolution's time depends on its shape as no count says (docs/benchmarks/defaults.md): timed where
    there is an input to time on; dense layers counted (deterministic); nothing to price without an input."""
    assert pricing(convolutions=True, inputs=True) == "timed"
    assert pricing(convolutions=False, inputs=True) == "counted"
    assert pricing(convolutions=True, inputs=False) == pricing(convolutions=False, inputs=False) == "parameters"
