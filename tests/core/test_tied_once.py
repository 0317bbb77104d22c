"""A tied weight's gradient is summed once: in the tied sum, not again in its stage's own collectives at SYNC.

The runtime leaves a tied parameter (a token embedding and the head reusing it) out of its stage's data-parallel
all-reduce and out of sharding (``whole`` in ``runtime/hybrid/hybrid.py``) and sums it in an all-reduce of its own
(``runtime/frontends/tied.py``). Before, the planner (``candidate.sync_costs``), the run's calibration
(``recalibrate.ring_synced``) and the default cut's word against 1F1B priced it otherwise: the first two in both
sums, the last in neither. Hand-computed times, binary-exact where the arithmetic is; no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.partition import CountedLayer, Rates, estimated_profile
from stagewise.planning import Link, search
from stagewise.planning.comm import posted_ring_all_reduce, ring_all_reduce
from stagewise.planning.defaults import against_1f1b
from stagewise.planning.recalibrate import calibrate_run, held_out_costs, ring_synced
from stagewise.planning.tied_sum import reduced_bytes
from stagewise.simulation import CostModel, shared_makespan, tied_done

#: 4 layers of F 1 s, I 1 s, W 1 s; the first holds the embedding (2048 bytes) and 1024 bytes more, the last reuses
#: the embedding (holds none)
UNTIED = fake_profile([3.0] * 4, params=[2048.0, 1024.0, 0.0, 0.0])
TIED = replace(UNTIED, tied=(((0, 3), 2048.0),))
ONE_MACHINE = dict(nodes=1, inter=Link(4.0, 1024.0), intra=Link(0.5, 4096.0), recompute=[None], top=20)


def _sync(profile: object, **options: object) -> dict[str, float]:
    plans = search(profile, 2, global_batch=2, schedules=["1f1b"], **ONE_MACHINE, **options).plans  # type: ignore[arg-type]
    return {p.describe(): p.breakdown["grad_sync"] for p in plans if p.layout.pp == 1}


def test_a_stage_leaves_its_tied_weight_out_of_its_own_collectives() -> None:
    """pp=1 on 2 processes of one machine (0.5 s, 4096 B/s): one stage holds all 3072 bytes, 2048 of them the tied
    embedding. Its replicas sum the embedding in the tied sum, a ring of 2: 2 (0.5 + 2048 / 8192) = 1.5 s from the
    SYNC; the stage's own collectives move the other 1024 bytes: dp 2, an all-reduce of 2 (0.5 + 1024 / 8192) =
    1.25 s beside it; sharding 2, a gather and a reduce-scatter of the same, 1.25 s at the SYNC. The step waits
    1.5 s after the last compute either way (counting the embedding in the stage's own: 1.75 s)."""
    untied, tied = _sync(UNTIED), _sync(TIED)
    assert sorted(untied) == sorted(tied) and len(tied) == 2  # pp=1 x dp=2, pp=1 x sharding=2
    assert set(untied.values()) == {2 * (0.5 + 3072 / 8192)}  # no tie: every byte in the stage's own
    assert set(tied.values()) == {2 * (0.5 + 2048 / 8192)}


def test_a_tie_of_no_bytes_plans_bit_for_bit_as_no_tie() -> None:
    """The stage's bytes less a tie of 0 bytes are its bytes: every plan of every layout (dp, sharding, pp, on one
    machine and on two) has the same step, to the bit, as without the set."""
    zero = replace(UNTIED, tied=(((0, 3), 0.0),))
    for nodes in (1, 2):
        options = {**ONE_MACHINE, "nodes": nodes}
        plain = search(UNTIED, 2, global_batch=2, schedules=["1f1b", "zb-v"], **options).plans  # type: ignore[arg-type]
        again = search(zero, 2, global_batch=2, schedules=["1f1b", "zb-v"], **options).plans  # type: ignore[arg-type]
        assert [(p.describe(), p.partition, p.step_time, p.breakdown) for p in again] == [
            (p.describe(), p.partition, p.step_time, p.breakdown) for p in plain
        ]


def test_the_bytes_come_out_of_the_stage_of_the_first_use_never_below_zero() -> None:
    """The first use holds the tied matrix: its stage, under any cut, drops the set's bytes; a later use's stage
    holds none to drop; a stage holding less than the set (a layer split by tp) reduces nothing."""
    assert reduced_bytes([8.0, 2048.0, 16.0], [0, 1, 2, 4], [((1, 3), 2048.0)]) == (8.0, 0.0, 16.0)
    assert reduced_bytes([2056.0, 16.0], [0, 2, 4], [((1, 3), 2048.0)]) == (8.0, 16.0)
    assert reduced_bytes([512.0, 16.0], [0, 2, 4], [((0, 3), 2048.0)]) == (0.0, 16.0)
    assert reduced_bytes([2056.0, 16.0], [0, 2, 4], [((0, 2), 1024.0), ((1, 3), 1024.0)]) == (8.0, 16.0)
    assert reduced_bytes([2056.0, 16.0], [0, 2, 4], []) == (2056.0, 16.0)
    with pytest.raises(ValueError, match="2 stages' parameter bytes for a cut of 3"):
        reduced_bytes([2056.0, 16.0], [0, 1, 2, 4], [])


def test_the_calibration_s_sync_leaves_the_tied_weight_out_as_the_plan_cuts_it() -> None:
    """A run of 1F1B on 2 ranks, cut 2 + 2, at 2 replicas; layer 1 holds a 2048-byte embedding that layer 3 reuses.
    Each stage's SYNC is a ring of 2 over the reduce link (the calibrated 0.5 s, bandwidth unbounded: 1 s a
    stage with bytes to move): the calibrating plan's stage 0 keeps layer 0's 8 bytes; a plan Q cut 1 + 3 puts the
    embedding on stage 1, which then has nothing of its own to reduce; with no counts, the calibrating plan's cut."""
    prior = replace(fake_profile([3.0] * 4, params=[8.0, 2048.0, 0.0, 0.0]), tied=(((1, 3), 2048.0),))
    plan = build_schedule("1f1b", 2, 4)
    run = simulate(plan, prior.cost_model([0, 2, 4], latency=0.5)).timeline
    cal = calibrate_run([run] * 3, plan, prior, [2, 2], cores=8, dp=2, tied=[[1, 3]])
    one = ring_all_reduce(8.0, 2, cal.reduce_link)
    assert one == 1.0
    assert ring_synced(cal.profile(prior).cost_model([0, 2, 4]), 2, cal).sync_time == (one, 0.0)
    assert held_out_costs(cal, prior, [2, 2], dp=2).sync_time == (one, 0.0)
    assert held_out_costs(cal, prior, [1, 3], dp=2).sync_time == (one, 0.0)
    untied = replace(cal, tied=())
    assert held_out_costs(untied, prior, [1, 3], dp=2).sync_time == (one, one)


def test_the_word_against_1f1b_counts_the_tied_sum_1f1b_pays_and_the_v_does_not() -> None:
    """Eight layers whose transfers dwarf their compute: ZB-V (two stages a rank, twice the messages) is predicted
    slower than 1F1B. Tie the first layer to the last, 1 MB: 1F1B holds them on its two ranks and its step waits for
    a ring of 2 on the link after its last SYNC, 2 (2 x 1 ms + 1e6 / 2e9) = 5 ms; the V holds both on rank 0 and
    sums nothing at one replica. Then the V is the faster."""
    rates = Rates(flops=1e9, bytes=1e9, per_op=0.0)
    layers = [CountedLayer(f"l{k}", 1e3, 2e3, 0.0, 0.0, 0, 0, 1.0, 4.0, 1e6) for k in range(8)]
    plain = estimated_profile(layers, rates)
    tied = replace(plain, tied=(((0, 7), 1e6),))
    zbv = build_schedule("zb-v", 2, 8, 2)
    link = dict(latency=1e-3, bandwidth=1e9)
    before, after = against_1f1b(plain, zbv, [2, 2, 2, 2], **link), against_1f1b(tied, zbv, [2, 2, 2, 2], **link)
    assert before is not None and after is not None and before.slower
    ring = posted_ring_all_reduce(1e6, 2, Link(1e-3, 1e9))
    assert ring == pytest.approx(5e-3, rel=1e-12)
    assert after.predicted == before.predicted
    assert after.one_f_one_b == pytest.approx(before.one_f_one_b + ring, rel=1e-12)
    assert not after.slower and after.ratio < 1


def test_the_sum_starts_at_the_sync_s_start_on_every_timed_step() -> None:
    """GPipe on 2 ranks, 1 micro-batch, F 1 s, B 2 s and a SYNC of 1 s: rank 1 F [1, 2] B [2, 4] SYNC [4, 5]; rank 0
    F [0, 1] B [4, 6] SYNC [6, 7]. A 3 s sum over both stages starts at rank 0's SYNC's start, 6, and is done at 9
    (the runtime starts it as the SYNC begins): alike in the simulator's timed step and in the replay on shared
    cores."""
    costs = replace(CostModel.uniform(2, forward=1.0, backward_input=1.0, backward_weight=1.0), sync_time=(1.0, 1.0))
    schedule = build_schedule("gpipe", 2, 1)
    assert tied_done(simulate(schedule, costs), [((0, 1), 3.0), ((1,), 3.0)]) == (9.0, 7.0)
    assert shared_makespan(schedule, costs, [1.0, 1.0], 2.0, tied=[((0, 1), 3.0)]) == 9.0
    assert tied_done(simulate(schedule, costs), []) == ()
