"""The runtime's RunCalibrator on the held-out benchmark's model (issue 49 item 2): each calibrating step timed
by the caller (the bias, the spread and the report then taken against those), and the replicas' all-reduce
link probed apart. Simulated timelines, no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.runtime import RunCalibrator

PRIOR = fake_profile([3.0, 3.0])


def fake_pipe() -> SimpleNamespace:
    """What the calibrator reads of a pipeline: 1F1B at 2 ranks, 4 micro-batches, a layer a stage."""
    return SimpleNamespace(
        schedule=build_schedule("1f1b", 2, 4), layer_ranges=[range(0, 1), range(1, 2)], layer_profile=PRIOR,
        num_ranks=2, rank=0, frontend=object(), transport=SimpleNamespace(guard=SimpleNamespace(wait=None)),
    )  # fmt: skip


def test_timed_steps_set_the_bias_and_the_report() -> None:
    """The simulated run is 15 s a step (F 1 s, B 2 s); the caller timed the calibrating steps at 16.5, 18 and
    19.5 s (a warm-up at 30 s left out): bias 18 / 15, the plan predicted at 18 s; the steps after, timed 18 and
    20 s, are what the report measures (median 19), not the timelines' 15 s."""
    run = simulate(build_schedule("1f1b", 2, 4), PRIOR.cost_model([0, 1, 2])).timeline
    assert run.makespan == 15.0
    calibrator = RunCalibrator(fake_pipe(), cores=8, warmup=1, reduce=(0.25, 50.0), reduce_cpu=0.5, link_cpu=0.25)
    for seconds in (30.0, 16.5, 18.0, 19.5):
        calibrator.observe(run, step_s=seconds)
    record = calibrator.records[0]
    assert record["steps_from"] == "timed" and record["steps_s"] == [16.5, 18.0, 19.5]
    assert record["bias"] == pytest.approx(18.0 / 15.0, rel=1e-9) and record["reduce_link"] == [0.25, 50.0]
    assert record["reduce_cpu"] == 0.5 and calibrator.calibration is not None
    assert calibrator.calibration.reduce_cpu == 0.5  # what the held-out SYNCs take (ring_synced)
    assert record["link_cpu"] == 0.25 and calibrator.calibration.link_cpu == 0.25  # what its plans' messages take
    with pytest.raises(ValueError, match="reduce_cpu is a share of the SYNC's time, in \\[0, 1\\], got 2"):
        RunCalibrator(fake_pipe(), cores=8, reduce=(0.25, 50.0), reduce_cpu=2)
    with pytest.raises(ValueError, match="link_cpu is a share of a core, in \\[0, 1\\], got -0.1"):
        RunCalibrator(fake_pipe(), cores=8, link_cpu=-0.1)
    for given, words in (  # each failed the first calibration, steps later (an IndexError, the planner's names)
        ({"speeds": [1.0]}, "speeds needs one value per rank \\(2\\), got 1"),
        ({"speeds": [1.0, -0.5]}, "speeds must be finite numbers > 0"),
        ({"caps": [0, 1]}, "caps must be finite numbers > 0"),
        ({"caps": [1.0, 1.0, 1.0]}, "caps needs one value per rank"),
        ({"cores": 0}, "cores \\(the cores the job's processes share\\) must be > 0, got 0"),
        ({"cores": -2}, "cores .* must be > 0, got -2"),
        ({"processes": -1}, "processes must be an int >= 1, got -1"),
    ):
        with pytest.raises(ValueError, match=f"RunCalibrator: {words}"):
            RunCalibrator(fake_pipe(), **{"cores": 8, **given})
    assert record["predicted_s"] == pytest.approx(18.0, rel=1e-9)
    for seconds in (18.0, 20.0):
        calibrator.observe(run, step_s=seconds)
    report = calibrator.report()
    assert report["measured_s"] == 19.0 and report["error"] == pytest.approx(18.0 / 19.0 - 1, rel=1e-9)


def test_untimed_steps_fall_back_to_the_makespans() -> None:
    """One calibrating step without a time: the calibration takes every step's makespan (bias 1), and says so."""
    run = simulate(build_schedule("1f1b", 2, 4), PRIOR.cost_model([0, 1, 2])).timeline
    calibrator = RunCalibrator(fake_pipe(), cores=8, warmup=0)
    for seconds in (16.5, None, 19.5):
        calibrator.observe(run, step_s=seconds)
    record = calibrator.records[0]
    assert record["steps_from"] == "makespans" and record["bias"] == pytest.approx(1.0, rel=1e-9)
    assert record["reduce_link"] is None
    with pytest.raises(ValueError, match="step_s must be > 0 seconds"):
        calibrator.observe(run, step_s=0.0)


def test_the_cores_are_the_node_s_from_every_rank_s_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cores given: the calibrator takes every rank's CPUs when it calibrates. Two ranks pinned a core each
    (each sees 1 CPU) share the node's 2: the run's overlapping F and B keep their lengths (F 1 s, B 2 s), where a
    model of one core would halve them, and the record says the ranks were pinned."""
    from stagewise.runtime.calibration import from_run

    monkeypatch.setattr(from_run, "node_layout", lambda wait: ([[0], [1]], ["agent 0", "agent 0"]))
    monkeypatch.setattr(from_run.os, "sched_getaffinity", lambda pid: {0})  # what a pinned rank sees of itself
    run = simulate(build_schedule("1f1b", 2, 4), PRIOR.cost_model([0, 1, 2])).timeline
    calibrator = RunCalibrator(fake_pipe(), warmup=0, after=1)
    calibrator.observe(run)
    record = calibrator.records[0]
    assert record["cores"] == 2.0 and record["pinned"] is True and record["affinity"] == [[0], [1]]
    assert calibrator.cores == 2.0 and calibrator.calibration is not None
    assert {k.name: v for k, v in calibrator.calibration.measured.items()} == {
        "F": {0: 1.0, 1: 1.0}, "B": {0: 2.0, 1: 2.0}
    }  # fmt: skip
    given = RunCalibrator(fake_pipe(), cores=8, warmup=0, after=1)  # cores given: no gather, nothing recorded
    given.observe(run)
    assert given.records[0]["cores"] == 8.0 and given.records[0]["affinity"] is None
    assert given.records[0]["pinned"] is None


def test_without_a_process_group_the_affinity_is_this_process_s() -> None:
    import os

    from stagewise.runtime.measure.cores import node_affinity

    assert node_affinity() == [sorted(os.sched_getaffinity(0))]


def test_the_pipeline_s_tied_layers_are_summed_in_the_prediction() -> None:
    """The pipeline ties its two layers (an embedding and the head reusing it: ``pipe.tied.layer_sets``), one on
    each rank; transfers take 0.5 s. Each calibrating step waited 2 s for their gradient sum after the makespan (a
    ring of 2 ranks: 2 steps of a notice and a message, 0.5 s each) and was timed so: the model holds the sum, so
    the bias is 1 and the plan is predicted at its timed step."""
    prior = fake_profile([3.0, 3.0], params=[512.0, 0.0])
    run = simulate(build_schedule("1f1b", 2, 4), prior.cost_model([0, 1, 2], latency=0.5)).timeline
    pipe = fake_pipe()
    pipe.layer_profile, pipe.tied = prior, SimpleNamespace(layer_sets=((0, 1),))
    calibrator = RunCalibrator(pipe, cores=8, warmup=0)
    for _ in range(3):
        calibrator.observe(run, step_s=run.makespan + 2.0)
    record = calibrator.records[0]
    assert record["bias"] == pytest.approx(1.0, rel=1e-12)
    assert record["predicted_s"] == pytest.approx(run.makespan + 2.0, rel=1e-12)


@pytest.mark.parametrize("machines", [["agent 0", "agent 1"], ["agent 0", "agent 0"]])
def test_the_link_between_machines_keeps_the_inter_probe(monkeypatch: pytest.MonkeyPatch, machines: list[str]) -> None:
    """Given a calibration with both probes, a run whose two ranks are on two machines fits its one message size
    with the inter probe's bandwidth; on one machine, with the intra probe's (a loopback ping-pong kept for the
    link between machines priced a 100 Mbit link at 4.2 GB/s, issue 49)."""
    from stagewise.planning import Calibration, Link
    from stagewise.runtime.calibration import from_run

    monkeypatch.setattr(from_run, "node_layout", lambda wait: ([[0, 1], [0, 1]], machines))
    run = simulate(build_schedule("1f1b", 2, 4), PRIOR.cost_model([0, 1, 2], latency=0.5)).timeline
    probes = Calibration(intra=Link(1e-5, 4e9), inter=Link(1e-3, 1.2e7))
    calibrator = RunCalibrator(fake_pipe(), warmup=0, after=1, bandwidth=probes)
    calibrator.observe(run)
    record = calibrator.records[0]
    spans = machines[0] != machines[1]
    assert record["nodes"] == ([0, 1] if spans else [0, 0])
    assert record["bandwidth_Bps"] == (1.2e7 if spans else 4e9)
    assert record["latency_s"] == pytest.approx(0.5 - 1.0 / record["bandwidth_Bps"], rel=1e-9)


def test_replicas_inside_a_machine_are_read_from_the_mesh() -> None:
    """pp 2 x dp 2 (the mesh's axes pp, dp, sharding, tp; ranks 0-1 the first pipeline rank's replicas): on two
    machines of two ranks each replica group shares a machine; placed round the machines it does not."""
    import torch

    from stagewise.runtime.calibration.from_run import replicas_inside

    mesh = SimpleNamespace(mesh=torch.arange(4).reshape(2, 2, 1, 1), mesh_dim_names=("pp", "dp", "sharding", "tp"))
    pipe = SimpleNamespace(hybrid=SimpleNamespace(mesh=SimpleNamespace(device_mesh=mesh)))
    assert replicas_inside(pipe, ["a", "a", "b", "b"])
    assert not replicas_inside(pipe, ["a", "b", "a", "b"])
    assert not replicas_inside(pipe, ["a", "a"])  # machines for fewer ranks than the mesh: not known
    assert not replicas_inside(SimpleNamespace(), ["a"])  # no mesh
