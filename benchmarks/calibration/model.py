"""The two cost models the held-out benchmarks compare, from what a job keeps (pure: no torch, so that a model
change can be evaluated offline against a stored quiet run, ``python -m benchmarks.calibration.refit JSON``).

* ``before``: the calibration as :class:`~stagewise.runtime.RunCalibrator` makes it: the layers' costs scaled
  linearly to a plan's micro-batch, the model's miss on the calibrating plan a factor on every step (the bias);
* ``at batch``: ``before`` with each plan's layers profiled at its own micro-batch (the first term of
  :mod:`stagewise.planning.action_cost` alone);
* ``after``: both terms: the layers at each plan's micro-batch, and every compute action's CPU time outside its
  compute event, measured on P's timeline, priced on the shared cores (the bias keeps the rest); and, where the
  job probed it (:mod:`.reduce_probe`), the replicas' all-reduce on its own link rather than the point-to-point
  one; across machines, each message's CPU at both ends while on the link (``link_cpu``, probed by the worker).

Both are calibrated on the calibrating plan P's timelines only; nothing of a plan Q enters them. Each waits, in
every plan and in P, for the gradient sum of the layers the workload ties across stages (the GPTs' head and token
embedding: :mod:`stagewise.planning.tied_sum`), as the plan's cut places them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from stagewise import LayerProfile, build_schedule
from stagewise.ir import Schedule, Timeline
from stagewise.planning import pipeline_nodes

# internal: the held-out prediction itself (a plan's costs from the calibration, before it runs)
from stagewise.planning.recalibrate import Prediction, RunCalibration, calibrate_run, held_out_costs
from stagewise.simulation import simulate

MODELS = ("before", "at batch", "after")


def calibrations(
    timelines: Sequence[Timeline], schedule: Schedule, profile: LayerProfile, counts: Sequence[int], cores: float,
    bandwidth: float, reduce: Sequence[float] | None = None, steps: Sequence[float] | None = None,
    affinity: Sequence[Sequence[int]] | None = None, nodes: Sequence[int] | None = None,
    tied: Sequence[Sequence[int]] = (), local_bandwidth: float | None = None, link_cpu: float = 0.0,
) -> dict[str, RunCalibration]:  # fmt: skip
    """P's run calibrated for each model (module docstring); ``reduce``: the probed all-reduce link
    ``(latency, bandwidth)``, a third item where each replica group was timed alone: the share of a SYNC that is
    CPU work on the shared cores (:attr:`~stagewise.planning.recalibrate.RunCalibration.reduce_cpu`), ``steps``: P's
    steps timed as the plans Q are (``timed_step``), both the ``after`` model's (``before`` and ``at batch`` take
    the bias against the timelines' makespans, as the runtime does);
    ``affinity``: each rank's CPUs, which then give the cores every model shares (``cores`` left out:
    :mod:`stagewise.planning.core_share`); ``nodes``: P's pipeline ranks' machines (:func:`nodes_of`), so that
    each model fits the link between machines apart from the one inside a machine (None: one link); ``tied``: the
    sets of the profile's layers the workload ties across stages (:func:`tied_of`); ``bandwidth`` and
    ``local_bandwidth``: the prior bandwidths between machines and inside one (a job kept before 2026-12-05 20:00
    has one, its ranks 0-1 ping-pong's, inside a machine at 4 processes); ``link_cpu``: the probed share of a
    core a message between machines takes at each end (the ``after`` model's; 0 in jobs kept before 2026-12-06
    08:00)."""
    c = None if affinity else cores
    # where P's pipeline ranks share machines (2 processes a machine), the space's dp 2 replicas do too: the mesh
    # packs pp outermost (nodes_of)
    inside = nodes is not None and len(set(nodes)) < len(nodes)
    plain = calibrate_run(timelines, schedule, profile, counts, c, bandwidth, affinity=affinity or None, nodes=nodes,
                          tied=tied, local_bandwidth=local_bandwidth, replicas_inside=inside)  # fmt: skip
    link = None if reduce is None else (float(reduce[0]), float(reduce[1]))
    # the SYNC's CPU share: kept since 2026-12-06 (at first ``true``, read as 1: all CPU); before, two items: a wait
    cpu = float(reduce[2]) if reduce is not None and len(reduce) > 2 else 0.0
    per_action = calibrate_run(
        timelines, schedule, profile, counts, c, bandwidth, per_action=True, steps=steps, reduce=link,
        affinity=affinity or None, nodes=nodes, tied=tied, local_bandwidth=local_bandwidth, replicas_inside=inside,
        reduce_cpu=cpu, link_cpu=link_cpu,
    )  # fmt: skip
    return {"before": plain, "at batch": plain, "after": per_action}


def nodes_of(pp: int, processes: int, per_machine: int | None) -> list[int] | None:
    """Each pipeline rank's machine for a plan of ``pp`` stages' ranks over ``processes`` processes,
    ``per_machine`` on each machine, ranks packed in order with pp outermost (the mesh's axes:
    :func:`stagewise.planning.comm.pipeline_nodes`); None on one machine (one link, as before ``nodes``)."""
    if per_machine is None or per_machine >= processes:
        return None
    return pipeline_nodes(pp, processes, per_machine)


def predictions(
    cals: Mapping[str, RunCalibration], profiles: Mapping[int, LayerProfile], b_p: int, schedule: Schedule,
    counts: Sequence[int], b_q: int, dp: int, processes: int, per_machine: int | None = None,
) -> dict[str, Prediction]:  # fmt: skip
    """Plan Q (its ``schedule``, ``counts`` layers per stage, ``b_q`` samples per micro-batch, ``dp`` replicas)
    predicted by each model; ``profiles``: the layers profiled alone per micro-batch size (P's is ``b_p``);
    ``per_machine``: processes per machine where the job spans machines (:func:`nodes_of`)."""
    prior, out = profiles[b_p], {}
    nodes = nodes_of(schedule.num_ranks, processes, per_machine)
    for model in MODELS:
        at = profiles.get(b_q) if model != "before" else None
        costs = held_out_costs(cals[model], prior, counts, batch_ratio=b_q / b_p, dp=dp, at=at)
        tied = cals[model].tied_sums(counts, schedule, dp, nodes)
        out[model] = cals[model].predict(schedule, costs, processes_per_node=processes, nodes=nodes, tied=tied)
    return out


def peaks(
    profiles: Mapping[int, LayerProfile], b_p: int, schedule: Schedule, counts: Sequence[int], b_q: int
) -> dict[str, list[float]]:
    """Plan Q's activation peak per rank (bytes alive at once, the simulator's), from the layers profiled alone
    only: ``before``, P's micro-batch's bytes scaled linearly to Q's; ``after``, the profile at Q's micro-batch
    (:mod:`.peaks`). The bytes are the profile's: a run's calibration scales times, not bytes."""
    out = {}
    for model, at in (("before", None), ("after", profiles.get(b_q))):
        profile, ratio = (profiles[b_p], b_q / b_p) if at is None else (at, 1.0)
        layers = tuple(_bytes_scaled(x, ratio) for x in profile.layers)
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        costs = replace(profile, layers=layers).cost_model(bounds)
        out[model] = [float(b) for b in simulate(schedule, costs).peak_activation_bytes]
    return out


def _bytes_scaled(layer: Any, ratio: float) -> Any:
    a, w = layer.activation_bytes * ratio, layer.weight_activation_bytes * ratio
    return replace(layer, activation_bytes=a, weight_activation_bytes=w)


def kept(
    profiles: Mapping[int, LayerProfile], timelines: Sequence[Timeline], calibrating: Mapping[str, Any],
    counts: Sequence[int], cores: float, bandwidth: float, processes: int, reduce: Sequence[float] | None = None,
    steps: Sequence[float] | None = None, affinity: Sequence[Sequence[int]] | None = None,
    per_machine: int | None = None, tied: Sequence[Sequence[int]] = (), local_bandwidth: float | None = None,
    link_cpu: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """What an offline refit needs, as JSON: the profiles, P's calibrating timelines and plan, its cut, the cores,
    the link's prior bandwidth, the processes on the node, the probed all-reduce link, P's timed steps and each
    rank's CPUs (its affinity, as the runtime's calibrator gathered it), the processes per machine where the
    job spans machines, the layers tied across stages, and the probed CPU share of a message between machines."""
    return {
        "link_cpu": link_cpu,
        "tied": [list(t) for t in tied],
        "per_machine": per_machine,
        "affinity": None if affinity is None else [list(a) for a in affinity],
        "reduce_link": None if reduce is None else list(reduce),
        "timed_steps": None if steps is None else list(steps),
        "profiles": {str(b): p.to_json() for b, p in profiles.items()},
        "timelines": [t.to_json() for t in timelines],
        "calibrating": dict(calibrating),
        "counts": list(counts),
        "cores": cores,
        "bandwidth": bandwidth,
        "local_bandwidth": local_bandwidth,
        "processes": processes,
    }


def affinity_of(job: Mapping[str, Any]) -> list[list[int]]:
    """Each rank's CPUs in a stored job: as kept, or, for a job that kept none (before ``calib5``), as its
    launch made them: ``pin`` (one rank a core: :func:`stagewise.runtime.measure.cores.core_sets`, whose each rank
    saw and kept ``cores`` CPUs of its own) or free (every rank on the ``cores`` CPUs it kept)."""
    keep = job["kept"]
    if keep.get("affinity"):
        return [list(a) for a in keep["affinity"]]
    k, n = int(keep["cores"]), int(keep["processes"])
    return [list(range(r * k, (r + 1) * k)) for r in range(n)] if job.get("pin") else [list(range(k))] * n


#: the layers each workload ties across stages, by name, for jobs that kept none (before ``tied``): the GPTs of
#: ``benchmarks.fidelity.workloads`` reuse the token embedding as the head (``examples/gpt_model.py``)
TIED_BY_NAME = (("tokens", "head"),)


def tied_of(job: Mapping[str, Any]) -> list[list[int]]:
    """The sets of layers (indices into the profiles) a stored job's workload ties across stages: as kept, or, for
    a job that kept none (before ``tied``), those of :data:`TIED_BY_NAME` its profile's layers are named."""
    keep = job["kept"]
    if keep.get("tied") is not None:
        return [list(t) for t in keep["tied"]]
    names = next(iter(LayerProfile.from_json(p) for p in keep["profiles"].values())).names
    return [[names.index(n) for n in group] for group in TIED_BY_NAME if all(n in names for n in group)]


def schedule_of(plan: Mapping[str, Any], virtual: int | None) -> Schedule:
    """The schedule a benchmark plan runs (as the pipeline builds it: no optimizer steps)."""
    return build_schedule(plan["schedule"], plan["pp"], plan["microbatches"], virtual)


def per_machine_of(job: Mapping[str, Any]) -> int | None:
    """Processes per machine of a stored job that spans machines: as kept, or, for a link job that kept none
    (before ``nodes``), half its processes (:mod:`.netem` runs every job on 2 machines); None on one machine."""
    keep = job["kept"]
    if keep.get("per_machine"):
        return int(keep["per_machine"])
    return int(keep["processes"]) // 2 if job.get("link") is not None else None


def refit(
    job: Mapping[str, Any], global_batch: int, reduce: Sequence[float] | None = None, p_swept: bool = False,
    split: bool = True,
) -> list[dict[str, Any]]:  # fmt: skip
    """Every plan of a stored job predicted again by the current code of each model, from the job's ``kept``
    record alone: per plan its name, measured steps and ``{model: (step, low, high)}``. For a job that kept no
    probe or timed P: ``reduce``, an all-reduce link probed elsewhere; ``p_swept``, P's steps timed as a swept
    plan (a regret job sweeps P first), that row then left out of the rows returned (what-ifs the caller says)."""
    keep = job["kept"]
    reduce = keep.get("reduce_link") or reduce
    steps, plans = keep.get("timed_steps"), list(job["plans"])
    if steps is None and p_swept:
        at = next((k for k, r in enumerate(plans) if r["plan"] == keep["calibrating"]), None)
        if at is not None:
            steps = plans.pop(at)["steps"]
    profiles = {int(b): LayerProfile.from_json(p) for b, p in keep["profiles"].items()}
    p_plan = keep["calibrating"]
    b_p = global_batch // (p_plan["dp"] * p_plan["microbatches"])
    timelines = [Timeline.from_json(t) for t in keep["timelines"]]
    p_schedule = schedule_of(p_plan, None)
    per_machine = per_machine_of(job) if split else None
    p_nodes = nodes_of(p_plan["pp"], keep["processes"], per_machine)
    local = keep.get("local_bandwidth")  # (absent before 2026-12-05 20:00: one prior for both links)
    cals = calibrations(timelines, p_schedule, profiles[b_p], keep["counts"], keep["cores"], keep["bandwidth"],
                        reduce, steps, affinity_of(job), p_nodes, tied_of(job), local,
                        float(keep.get("link_cpu") or 0.0) if split else 0.0)  # fmt: skip
    rows = []
    for r in plans:
        plan = r["plan"]
        b_q = global_batch // (plan["dp"] * plan["microbatches"])
        got = predictions(cals, profiles, b_p, schedule_of(plan, r.get("virtual")), r["counts"], b_q, plan["dp"],
                          keep["processes"], per_machine)  # fmt: skip
        rows.append({"plan": plan, "steps": r["steps"], "builds": r.get("builds"),
                     **{m: (p.step, p.low, p.high) for m, p in got.items()}})  # fmt: skip
    return rows
