"""Replanner's options are checked when it is made (no process group needed): a clear error, before any step."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from helpers.profiles import fake_profile
from stagewise import build_schedule, simulate
from stagewise.planning.stragglers import rank_speeds
from stagewise.runtime import Replanner, RunCalibrator


def _pipe() -> SimpleNamespace:
    return SimpleNamespace(
        schedule=build_schedule("1f1b", 2, 4), layer_ranges=[range(0, 4), range(4, 8)], layer_profile=None, num_ranks=2
    )


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="steps"):
        Replanner(_pipe(), steps=-1)
    with pytest.raises(ValueError, match="schedules= names 'no-such'"):
        Replanner(_pipe(), steps=10, schedules=["no-such"])
    with pytest.raises(ValueError, match=r"must be ints >= 0 .* got '10'"):
        Replanner(_pipe(), steps="10")  # type: ignore[arg-type]  (a raw TypeError from a comparison before)
    with pytest.raises(ValueError, match="relayout_s \\(seconds\\) must be a finite number >= 0, got -1"):
        Replanner(_pipe(), steps=10, relayout_s=-1)
    for bad in ({"cooldown": -1}, {"cooldown": 2.5}):
        with pytest.raises(ValueError, match="cooldown \\(steps between changes\\) must be an int >= 0"):
            Replanner(_pipe(), steps=10, **bad)
    for bad in ({"z": -1.0}, {"margin_s": -0.5}, {"margin_s": float("inf")}, {"z": float("nan")}):
        with pytest.raises(ValueError, match="margin_s \\(seconds\\) and z \\(spreads\\) must be finite"):
            Replanner(_pipe(), steps=10, **bad)


def test_good_options_are_kept() -> None:
    replanner = Replanner(_pipe(), steps=10, schedules=["zb-h1", "gpipe"], cooldown=3, margin_s=0.1)
    assert replanner.schedules == ("zb-h1", "gpipe") and replanner.log == []
    assert (replanner.decisions.cooldown, replanner.decisions.margin_s) == (3, 0.1)


def _run(speeds: list[float]) -> Any:
    """The simulator's timeline of 1F1B at 2 ranks with rank r's compute divided by ``speeds[r]``."""
    plan = build_schedule("1f1b", 2, 4)
    costs = fake_profile([1.0] * 8).cost_model([0, 4, 8])

    def slowed(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(x / speeds[plan.placement[s]] for s, x in enumerate(values))

    kinds = ("forward", "backward_input", "backward_weight", "backward_full")
    return simulate(plan, replace(costs, **{k: slowed(getattr(costs, k)) for k in kinds})).timeline


def test_a_calibration_told_the_speeds_keeps_a_slow_rank_slow() -> None:
    """Calibrated while rank 1 runs at 0.25, told so: its stages keep their full-speed costs, and the steps that
    follow measure rank 1 at 0.25 (a calibration not told takes the slowness for costly layers: speeds 1)."""
    pipe = SimpleNamespace(
        schedule=build_schedule("1f1b", 2, 4),
        layer_ranges=[range(0, 4), range(4, 8)],
        layer_profile=fake_profile([1.0] * 8),
        num_ranks=2,
        rank=0,
    )
    full = RunCalibrator(pipe, cores=2, warmup=0, after=3)
    told = RunCalibrator(pipe, cores=2, warmup=0, after=3, speeds=[1.0, 0.25])
    blind = RunCalibrator(pipe, cores=2, warmup=0, after=3)
    for _ in range(3):
        full.observe(_run([1.0, 1.0]))
        told.observe(_run([1.0, 0.25]))
        blind.observe(_run([1.0, 0.25]))
    assert told.calibration is not None and full.calibration is not None and blind.calibration is not None
    for kind, by_stage in full.calibration.measured.items():
        assert told.calibration.measured[kind] == pytest.approx(by_stage)
    assert rank_speeds(_run([1.0, 0.25]), told.calibration, 2) == pytest.approx([1.0, 0.25])
    assert rank_speeds(_run([1.0, 0.25]), blind.calibration, 2) == pytest.approx([1.0, 1.0])


def test_a_hetpipe_is_refused_by_name_before_any_step() -> None:
    """A HetPipe's virtual workers are re-laid out by no re-layout: watching one is refused with the reason, not
    an AttributeError from deep inside the calibration."""
    from stagewise.runtime.hetpipe import HetPipe

    hetpipe = object.__new__(HetPipe)  # its layout as the watch sees it: no single pipeline's cut
    for make in (lambda: RunCalibrator(hetpipe), lambda: Replanner(hetpipe, steps=10)):
        with pytest.raises(ValueError, match="a HetPipe has none"):
            make()


def test_a_lead_demanded_where_none_can_be_is_refused_with_why() -> None:
    with pytest.raises(ValueError, match="leader=True needs the pipeline's ranks to be the whole job: no process"):
        Replanner(_pipe(), steps=10, leader=True)
    assert Replanner(_pipe(), steps=10).lead is None  # the default: every rank alike where no lead can be


def test_the_prior_is_the_profile_priced_at_the_first_batch_and_kept() -> None:
    """A pipeline cut without a profile: a calibrator built before its first step asks the first batch to price
    the layers (``prior_wanted``); until then its prior is the flat one, from then on the priced profile, kept
    through a re-layout (whose pipeline has no profile of its own), and the Replanner decides by the same. A
    calibrator given a prior, or built after the first step, asks nothing."""
    from stagewise.runtime.calibration.from_run import flat_profile

    pipe = SimpleNamespace(**vars(_pipe()), train_steps=0)
    replanner = Replanner(pipe, steps=10)
    calibrator = replanner.calibrator
    assert pipe.prior_wanted and calibrator.prior == flat_profile([4, 4])
    priced = fake_profile([1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 1.0, 0.5])
    pipe.layer_profile, pipe.train_steps = priced, 1  # the first batch priced it, and the step ran
    assert calibrator.prior is priced and replanner.prior is priced
    pipe.layer_profile = None  # re-laid out: the new pipeline's fields
    assert calibrator.prior is priced and replanner.prior is priced
    given = SimpleNamespace(**vars(_pipe()), train_steps=0, prior_wanted=False)
    assert RunCalibrator(given, priced).prior is priced and not given.prior_wanted
    late = SimpleNamespace(**vars(_pipe()), train_steps=3, prior_wanted=False)
    assert RunCalibrator(late).prior == flat_profile([4, 4]) and not late.prior_wanted
