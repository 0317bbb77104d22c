"""Two links, one inside a machine and one between machines (issue 49, 2026-12-05): the simulator prices each
transfer on its own, and the run's calibration fits them apart.

At 4 processes on 2 machines a pipeline of 4 stages crosses the network at one boundary of three; one link fitted
through every transfer read a 10 ms delay as 2.75 ms. Hand-computed timelines, no processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.planning.link_fit import fit_link
from stagewise.planning.recalibrate import calibrate_run, fit_links
from stagewise.simulation import CostModel, shared_makespan

GPIPE4 = build_schedule("gpipe", 4, 1)
NODES = (0, 0, 1, 1)  # ranks 0, 1 on one machine; 2, 3 on the other


def four(latency: float = 10.0, local: float | None = 1.0, nodes: tuple[int, ...] = NODES) -> CostModel:
    """4 stages of F 1 s and B 2 s (I 1 + W 1), one byte out each, the link's latency between machines and
    ``local`` inside one."""
    costs = CostModel.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0, comm_time=latency)
    if local is None:
        return costs
    return replace(costs, rank_nodes=nodes, local_latency=local)


def test_a_transfer_inside_a_machine_takes_the_local_link() -> None:
    """GPipe, 1 micro-batch: F 4 x 1 s and B 4 x 2 s in a chain, each way 1 + 10 + 1 s of transfers: 36 s. One
    link for all: 3 x 10 s each way, 72 s."""
    assert simulate(GPIPE4, four()).makespan == pytest.approx(36.0)
    assert simulate(GPIPE4, four(local=None)).makespan == pytest.approx(72.0)
    apart = four(nodes=(0, 1, 2, 3))  # every rank a machine of its own: the local link is never taken
    assert simulate(GPIPE4, apart).makespan == pytest.approx(72.0)
    assert shared_makespan(GPIPE4, four(), [1.0] * 4, cores=8.0) == pytest.approx(36.0)


def test_the_two_simulators_agree_with_nodes_on_a_real_schedule() -> None:
    plan = build_schedule("1f1b", 4, 8)
    costs = four(latency=0.3, local=0.05)
    assert shared_makespan(plan, costs, [1.0] * 4, cores=8.0) == pytest.approx(simulate(plan, costs).makespan)


def test_nodes_for_another_number_of_ranks_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rank_nodes names 2 ranks' nodes, the schedule has 4 ranks"):
        simulate(GPIPE4, four(nodes=(0, 1)))
    with pytest.raises(ValueError, match="rank_nodes must be node numbers"):
        four(nodes=(0, -1, 1, 1))
    with pytest.raises(ValueError, match="local_latency >= 0"):
        replace(four(), local_latency=-1.0)


def test_the_cost_model_round_trips_its_nodes_through_json() -> None:
    costs = replace(four(), local_bandwidth=5e9)
    again = CostModel.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again == costs and again.rank_nodes == NODES and again.local_bandwidth == 5e9
    plain = four(local=None)
    assert "rank_nodes" not in plain.to_dict() and CostModel.from_dict(plain.to_dict()) == plain
    inf = CostModel.from_dict(json.loads(json.dumps(four().to_dict())))
    assert math.isinf(inf.local_bandwidth)


def test_the_run_fits_the_link_between_machines_apart_from_the_one_inside() -> None:
    """The run simulated with 10 s between machines and 1 s inside: each fit reads its own link exactly; one fit
    through all reads the median of the mixed delays (1 s here: two of three boundaries are local), the bias the
    4-process runs showed."""
    timeline = simulate(GPIPE4, four()).timeline
    between, inside = fit_links([timeline], GPIPE4, [1.0] * 4, nodes=NODES)
    assert inside is not None
    assert (between.latency, between.transfers, inside.latency, inside.transfers) == (10.0, 2, 1.0, 4)
    assert fit_link([timeline], GPIPE4, [1.0] * 4).latency == pytest.approx(1.0)
    one, none = fit_links([timeline], GPIPE4, [1.0] * 4, nodes=(0, 1, 2, 3))
    assert none is None and one.transfers == 6  # every rank its own machine: one link, as before
    with pytest.raises(ValueError, match="nodes names 3 pipeline ranks' nodes, the schedule has 4"):
        fit_links([timeline], GPIPE4, [1.0] * 4, nodes=(0, 0, 1))


def test_a_run_on_one_machine_gives_its_link_for_both() -> None:
    timeline = simulate(GPIPE4, four(latency=0.5, local=0.5, nodes=(0, 0, 0, 0))).timeline
    between, inside = fit_links([timeline], GPIPE4, [1.0] * 4, nodes=(0, 0, 0, 0))
    assert inside is not None and between.latency == inside.latency == 0.5
    assert "no waited transfer between nodes" in between.note


def test_a_held_out_plan_is_priced_on_both_links() -> None:
    """Calibrated on GPipe over 4 ranks of 2 machines, a 1F1B of 8 micro-batches on the same machines is predicted
    as the truth simulates it; laid out one rank per machine, every transfer takes the link between machines."""
    prior = fake_profile([3.0] * 4)
    truth = replace(prior.cost_model([0, 1, 2, 3, 4], latency=0.4), rank_nodes=NODES, local_latency=0.02)
    run = simulate(GPIPE4, truth).timeline
    cal = calibrate_run([run] * 3, GPIPE4, prior, [1, 1, 1, 1], cores=8, nodes=NODES)
    assert cal.latency == pytest.approx(0.4) and cal.local == (pytest.approx(0.02), math.inf)
    assert cal.nodes == NODES and "between nodes:" in cal.link and cal.bias == pytest.approx(1.0)
    q = build_schedule("1f1b", 4, 8)
    costs = cal.profile(prior).cost_model([0, 1, 2, 3, 4])
    got = cal.predict(q, costs, processes_per_node=4, nodes=NODES).step
    assert got == pytest.approx(simulate(q, truth).makespan, rel=1e-9)
    spread = cal.predict(q, costs, processes_per_node=4, nodes=(0, 1, 2, 3)).step
    assert spread == pytest.approx(simulate(q, replace(truth, rank_nodes=(0, 1, 2, 3))).makespan, rel=1e-9)
    assert spread > got


def test_each_link_keeps_its_own_prior_bandwidth() -> None:
    """One message size identifies no bandwidth, so each fit keeps a prior. The truth: 100 bytes a boundary, 1 byte/s
    between machines (100 s) and 100 bytes/s inside (1 s), no latency. Given its own prior, each link reads latency
    0; given the loopback's prior for both (a ping-pong inside a machine, issue 49), the link between machines reads
    its bytes' time as a latency of 99 s, which prices any larger message (a tied sum, an all-reduce) 100 times low."""
    costs = replace(
        CostModel.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0),
        output_bytes=(100.0,) * 4, bandwidth=1.0, rank_nodes=NODES, local_bandwidth=100.0,
    )  # fmt: skip
    timeline = simulate(GPIPE4, costs).timeline
    between, inside = fit_links([timeline], GPIPE4, [100.0] * 4, 1.0, nodes=NODES, local_prior=100.0)
    assert inside is not None
    assert (between.latency, between.bandwidth) == (pytest.approx(0.0, abs=1e-9), 1.0)
    assert (inside.latency, inside.bandwidth) == (pytest.approx(0.0, abs=1e-9), 100.0)
    loopback, same = fit_links([timeline], GPIPE4, [100.0] * 4, 100.0, nodes=NODES)
    assert same is not None and (same.latency, same.bandwidth) == (pytest.approx(0.0, abs=1e-9), 100.0)
    assert loopback.bandwidth == 100.0 and loopback.latency == pytest.approx(99.0)
    prior = fake_profile([3.0] * 4)  # one byte out of each layer
    truth = replace(prior.cost_model([0, 1, 2, 3, 4], bandwidth=0.01), rank_nodes=NODES, local_bandwidth=1.0)
    run = simulate(GPIPE4, truth).timeline
    cal = calibrate_run([run] * 3, GPIPE4, prior, [1, 1, 1, 1], cores=8, prior_bandwidth=0.01, nodes=NODES,
                        local_bandwidth=1.0)  # fmt: skip
    assert (cal.latency, cal.bandwidth) == (pytest.approx(0.0, abs=1e-9), 0.01)
    assert cal.local == (pytest.approx(0.0, abs=1e-9), 1.0) and cal.bias == pytest.approx(1.0)


def test_replicas_on_one_machine_fit_the_link_inside_it() -> None:
    """Two pipeline ranks, each a machine of its own with its data-parallel replicas (pp 2 x dp 2 over two
    machines): the replicas' all-reduce messages run inside a machine. Fitted with the transfers between machines
    (10 s of latency, one size, a prior of 1 byte/s) the fit through both reads neither link; fitted inside,
    the local link is theirs (0.5 s + bytes / 100) and the one between machines is the transfers'. Without a
    probe, the replicas' SYNC is then priced on the local link."""
    two = build_schedule("gpipe", 2, 2)
    costs = replace(CostModel.uniform(2, forward=1.0, backward_input=1.0, backward_weight=1.0, comm_time=10.0))
    timeline = simulate(two, costs).timeline
    local = [(b, 0.5 + b / 100.0) for b in (100.0, 400.0, 1600.0)]
    mixed, _ = fit_links([timeline], two, [1.0] * 2, 1.0, local, nodes=(0, 1))
    assert mixed.latency != pytest.approx(9.0, abs=1.0)  # the transfers between machines read wrong
    between, inside = fit_links([timeline], two, [1.0] * 2, 1.0, (), nodes=(0, 1), local_reductions=local)
    assert inside is not None and inside.identified
    assert (between.latency, between.bandwidth) == (pytest.approx(9.0), 1.0)
    assert (inside.latency, inside.bandwidth) == (pytest.approx(0.5), pytest.approx(100.0))
    one, none = fit_links([timeline], two, [1.0] * 2, 1.0, (), local_reductions=local)  # machines not known
    assert none is None and one.transfers == 2 + len(local)
    prior = fake_profile([3.0, 3.0])
    cal = calibrate_run([timeline] * 3, two, prior, [1, 1], cores=8, prior_bandwidth=1.0, dp=2,
                        reductions=local, nodes=(0, 1), replicas_inside=True)  # fmt: skip
    assert cal.replicas_inside and cal.local == (pytest.approx(0.5), pytest.approx(100.0))
    assert (cal.reduce_link.latency, cal.reduce_link.bandwidth) == (pytest.approx(0.5), pytest.approx(100.0))
    apart = calibrate_run([timeline] * 3, two, prior, [1, 1], cores=8, prior_bandwidth=1.0, dp=2,
                          reductions=local, nodes=(0, 1))  # fmt: skip
    assert not apart.replicas_inside and apart.reduce_link.latency == apart.latency
