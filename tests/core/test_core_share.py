"""Ranks pinned a core each (issue 49 item 2, ``stagewise run --pin-cores``): the cores the cost model shares come
from every rank's CPU affinity, not from one rank's; a pinned rank's CPU outside its compute events runs on its own
core, in series with its own compute. Hand-computed timelines, no processes."""

from __future__ import annotations

import pytest
from benchmarks.calibration.model import affinity_of
from test_action_cost import two_rank_run

from helpers.profiles import fake_profile
from stagewise import build_schedule
from stagewise.ir import Kind
from stagewise.planning.core_share import node_cores, pinned
from stagewise.planning.recalibrate import calibrate_run, held_out_costs

PINNED = [[0], [1]]  # what stagewise run --pin-cores gives 2 ranks on 2 cores: each sees one CPU


def test_the_node_s_cores_are_every_rank_s_cpus() -> None:
    """Pinned a core each, free on both, two a core each, held to one core together, unequal overlaps."""
    assert node_cores(PINNED) == 2.0 and pinned(PINNED)
    assert node_cores([[0, 1], [0, 1]]) == 2.0 and not pinned([[0, 1], [0, 1]])
    assert node_cores([[0, 1], [2, 3], [4, 5]]) == 6.0 and pinned([[0, 1], [2, 3], [4, 5]])
    assert node_cores([[3], [3]]) == 1.0 and not pinned([[3], [3]])
    assert node_cores([[0], [0, 1]]) == 2.0 and not pinned([[0], [0, 1]])
    assert pinned([[0, 1]])  # one rank alone has its CPUs to itself
    with pytest.raises(ValueError, match="non-empty set of CPUs per rank"):
        node_cores([[0], []])
    with pytest.raises(ValueError, match="non-empty set of CPUs per rank"):
        pinned([])


def test_a_pinned_rank_s_cpu_outside_compute_serialises_on_its_own_core() -> None:
    """The 1F1B run of ``two_rank_run`` (F 1 s, B 2 s) on two ranks pinned a core each. Each rank computes and
    posts on its own core: rank 0's posting [1, 1.25] and gap [1.25, 2] while rank 1 computes F0 count in full, the
    overhead is the gaps (0.75 + 0.5 + 0 + 0) / 4 actions counted, 0.3125 s an action, and the posting 0.25 s a
    message; every compute event is its own length (F 1, B 2). Held to one core (what the runtime took from each
    rank's own affinity), the overlaps halve: 0.15625 and 0.125 s, and the stages come out at half their cost.

    A held-out plan, GPipe over 4 micro-batches on the same cut: each action 0.3125 s more and 0.25 s for the one
    message it posts (F 1.5625, B 2.5625), no core shared, the link free (no waited transfer took time):
    (m + p - 1)(F + B) = 5 x 4.125 = 20.625 s, times the bias 9.5 / 12.375 (the run's step over the model's 1F1B
    at 2 micro-batches, 3 (F + B)): 15.8333 s."""
    one_f = build_schedule("1f1b", 2, 2)
    prior = fake_profile([3.0, 3.0])  # a layer a stage: F 1, B 2
    cal = calibrate_run([two_rank_run()], one_f, prior, [1, 1], None, per_action=True, affinity=PINNED)
    assert cal.cores == 2.0 and cal.pinned and cal.affinity == ((0,), (1,))
    assert (cal.overhead, cal.message_overhead) == (0.3125, 0.25)
    assert cal.measured == {Kind.F: {0: 1.0, 1: 1.0}, Kind.B: {0: 2.0, 1: 2.0}}
    assert cal.bias == pytest.approx(9.5 / 12.375, rel=1e-12)
    q = build_schedule("gpipe", 2, 4)
    got = cal.predict(q, held_out_costs(cal, prior, [1, 1]), processes_per_node=2)
    assert got.step == pytest.approx(20.625 * 9.5 / 12.375, rel=1e-12)
    one_core = calibrate_run([two_rank_run()], one_f, prior, [1, 1], 1.0, per_action=True)
    assert (one_core.overhead, one_core.message_overhead) == (0.15625, 0.125) and one_core.pinned is None


def test_cores_that_disagree_with_the_affinity_are_refused() -> None:
    """The runtime's old default, each pinned rank's own affinity (1 CPU), beside the ranks' affinity (2)."""
    run, one_f, prior = two_rank_run(), build_schedule("1f1b", 2, 2), fake_profile([3.0, 3.0])
    with pytest.raises(ValueError, match=r"cores 1.0 disagree with the ranks' affinity \[\[0\], \[1\]\]"):
        calibrate_run([run], one_f, prior, [1, 1], 1.0, affinity=PINNED)
    assert calibrate_run([run], one_f, prior, [1, 1], 2.0, affinity=PINNED).cores == 2.0
    with pytest.raises(ValueError, match="give cores"):
        calibrate_run([run], one_f, prior, [1, 1], None)


def test_a_stored_job_s_affinity_as_kept_or_as_its_launch_made_it() -> None:
    """The offline refit of a job that kept no affinity (before calib5): pinned, each rank kept its own CPUs as
    ``cores`` (1), so the node's are one a rank; free, every rank kept the node's 2."""
    kept = {"cores": 1.0, "processes": 2}
    assert affinity_of({"pin": True, "kept": kept}) == [[0], [1]]
    assert affinity_of({"pin": False, "kept": {"cores": 2.0, "processes": 4}}) == [[0, 1]] * 4
    assert affinity_of({"pin": True, "kept": {**kept, "affinity": [[3], [5]]}}) == [[3], [5]]
