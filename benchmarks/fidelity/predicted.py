"""What the simulator predicts for a schedule the pipeline ran (pure: stagewise's simulator, no torch).

Three predictions per schedule, each on the cut the pipeline ran (its ``layer_ranges``):

* *simulated*: the profile's costs (``LayerProfile.cost_model``, as the synthesizer, ``schedule="auto"`` and
  the planner see them) and the calibrated link (``latency + bytes / bandwidth`` per transfer): the figure
  the goals are judged on;
* *+ runtime*: the planner's prediction (:mod:`stagewise.planning.costing`): the same plus what
  ``sw.calibrate()`` measured of the runtime itself, ``action`` seconds per F and B (half to each of I and W),
  ``message`` per message a stage posts, ``step`` once per step, and each kind of compute scaled by what
  ``measure_compute_scale`` measured on the group over the profile (``k_F``, ``k_B``, ``k_IW``: ranks that
  share caches and memory bandwidth compute slower than one process alone); on more processes than cores,
  the makespan with the ranks sharing ``cores`` (:func:`stagewise.simulation.shared_makespan`); and the step
  waits for the gradient sum of layers tied across stages (the GPT's head reusing its embedding:
  :mod:`stagewise.planning.tied_sum`, from 2026-12-05);
* *at measured compute*: each stage's F, I, W and B as measured inside this very pipeline (mean over its
  timed steps), with the link: what the schedule and the link alone explain of the measured step. Where this
  is close and *simulated* is not, the compute costs differ between the profile and the pipeline (caches, core
  sharing); where both miss, the time is outside compute (messages, waits, the step's head and tail).

Feature detection keeps this working on code older than the measured split backward (``backward_full``
absent: B is I + W there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from stagewise import CostModel, LayerProfile, Schedule, simulate
from stagewise.planning import Link

# internal: the "+ runtime" prediction is the planner's own costing of a stage (no public name gives it)
from stagewise.planning.costing import LayerArrays, stage_base

# internal: the tied layers' gradient sum, priced as the planner prices it (no public name gives it for a cut)
from stagewise.planning.tied_sum import TiedSum, tied_bytes, tied_sums
from stagewise.simulation import shared_makespan, tied_done


def bounds_of(layer_ranges: Sequence[range]) -> list[int]:
    """A pipeline's ``layer_ranges`` (one range of layers per stage) as partition bounds ``[0, ..., layers]``."""
    return [r.start for r in layer_ranges] + [layer_ranges[-1].stop]


def full_backward(costs: CostModel) -> tuple[float, ...]:
    """B per stage: ``backward_full`` where the cost model has one, else I + W."""
    full = tuple(getattr(costs, "backward_full", ()) or ())
    return full or tuple(i + w for i, w in zip(costs.backward_input, costs.backward_weight))


def stage_costs(costs: CostModel) -> dict[str, list[float]]:
    """Per stage: seconds per action of each kind (``"F"``, ``"I"``, ``"W"``, ``"B"``), and the bytes a forward
    saves (``"saved"``, the loss's on the last stage included) and W holds after I (``"held"``)."""
    return {
        "F": list(costs.forward),
        "I": list(costs.backward_input),
        "W": list(costs.backward_weight),
        "B": list(full_backward(costs)),
        "saved": list(costs.activation_bytes),
        "held": list(costs.weight_activation_bytes),
    }


def with_overheads(
    costs: CostModel, action: float, message: float, scale: Sequence[float] = (1.0, 1.0, 1.0)
) -> CostModel:
    """``costs`` as the planner charges them, by the planner's own costing (:func:`stagewise.planning.costing.
    stage_base` at the profile's batch, each stage given as one layer): the runtime's fixed cost per action
    ``c_s = action + message x (messages stage s posts per action)`` added to each F and B, half of it to each
    of I and W, and each kind scaled by ``scale = (k_F, k_B, k_IW)``: ``F_s = k_F (f_s + c_s)``,
    ``B_s = k_B (b_s + c_s)``, ``I_s = k_IW (i_s + c_s / 2)``, ``W_s = k_IW (w_s + c_s / 2)``."""
    n = costs.num_stages
    zeros = (0.0,) * n
    stages_as_layers = LayerArrays(
        forward=tuple(costs.forward),
        backward_input=tuple(costs.backward_input),
        backward_weight=tuple(costs.backward_weight),
        activation=tuple(costs.activation_bytes),
        keep=zeros,
        parameters=zeros,
        output=zeros,
        tp_layer=(False,) * n,
        backward=full_backward(costs),
    )
    kf, kb, kiw = scale
    base = stage_base(
        stages_as_layers, list(range(n + 1)), tp=1, tp_link=Link(), recompute=None, overhead=zeros,
        action_overhead=action, message=message, factor=(kf, kb, kiw),
    )  # fmt: skip
    charged = base.at(1.0)
    out = replace(
        costs,
        forward=charged.forward,
        backward_input=charged.backward_input,
        backward_weight=charged.backward_weight,
    )
    if getattr(costs, "backward_full", ()):
        out = replace(out, backward_full=charged.backward)
    return out


def compute_scale(calibration: Mapping[str, Any]) -> tuple[float, float, float]:
    """``(k_F, k_B, k_IW)`` from the calibration (1 where not measured; code that measured two factors, F and
    B, charges I + W at B's)."""
    scale = [float(k) for k in calibration.get("compute_scale") or ()] or [1.0]
    return (scale[0], scale[min(1, len(scale) - 1)], scale[min(2, len(scale) - 1)])


def with_measured(costs: CostModel, means: Mapping[str, float]) -> CostModel:
    """``costs`` with each stage's F, I, W, B replaced by the mean measured in the pipeline (``means["I3"]``);
    a kind the schedule never ran keeps the profile's cost."""
    n = costs.num_stages

    def pick(kind: str, old: Sequence[float]) -> tuple[float, ...]:
        return tuple(means.get(f"{kind}{s}", old[s]) for s in range(n))

    out = replace(
        costs,
        forward=pick("F", costs.forward),
        backward_input=pick("I", costs.backward_input),
        backward_weight=pick("W", costs.backward_weight),
    )
    if getattr(costs, "backward_full", ()):
        out = replace(out, backward_full=pick("B", full_backward(costs)))
    return out


def tied_of(
    profile: LayerProfile, layer_sets: Sequence[Sequence[int]], counts: Sequence[int], schedule: Schedule, link: Link
) -> tuple[TiedSum, ...]:
    """The gradient sums of the pipeline's tied layers (``pipe.tied.layer_sets``, indices into ``profile``) on the
    cut of ``counts`` layers per stage, over ``link`` (one machine: the ranks' own link)."""
    return tied_sums(tied_bytes(profile, layer_sets), counts, schedule.placement, between=link)


def profile_costs(profile: LayerProfile, bounds: Sequence[int], latency: float, bandwidth: float) -> CostModel:
    """The profile summed over the cut, with the link (each code's own default for how I and W are charged)."""
    return profile.cost_model(list(bounds), latency=latency, bandwidth=bandwidth)


def predict(
    schedule: Schedule,
    costs: CostModel,
    calibration: Mapping[str, Any],
    cores: float | None,
    measured: Mapping[str, float] | None = None,
    tied: Sequence[TiedSum] = (),
) -> dict[str, Any]:
    """The three predictions of one schedule (seconds, bytes), and the simulated timeline (JSON).

    ``calibration``: ``action``, ``message`` and ``step`` seconds (``sw.calibrate()``'s) and ``compute_scale``
    (``measure_compute_scale``'s; absent: 1); ``cores``: the cores
    the ranks share (None: a core each); ``measured``: the pipeline's mean per (kind, stage) action; ``tied``:
    the tied layers' gradient sums (:func:`tied_of`) the "+ runtime" step waits for.
    """
    plain = simulate(schedule, costs)
    runtime = with_overheads(
        costs, calibration.get("action", 0.0), calibration.get("message", 0.0), compute_scale(calibration)
    )
    timed = simulate(schedule, runtime)
    with_runtime = max((timed.makespan, *tied_done(timed, tied)))
    shared = None
    if cores is not None and cores < schedule.num_ranks:
        shared = shared_makespan(schedule, runtime, [1.0] * schedule.num_ranks, cores, tied=tied)
    timeline = replace(plain.timeline, unit="s")
    out: dict[str, Any] = {
        "makespan": plain.makespan,
        "peak_bytes": list(plain.peak_activation_bytes),
        "with_runtime": max(with_runtime, shared or 0.0) + calibration.get("step", 0.0),
        "shared_cores": shared,
        "costs": stage_costs(costs),
        "timeline": timeline.to_json(),
    }
    if measured is not None:
        out["at_measured_compute"] = simulate(schedule, with_measured(costs, measured)).makespan
    return out
