"""The default cut without sample inputs, finished at the first batch: the inputs' shape is known only then.

A layer list built with ``partition="balanced"`` (the default) and no ``sample_inputs`` is cut before any
input is seen: by parameters, or evenly where a layer holds a convolution (whose work per parameter depends on
the image's size, :func:`stagewise.partition.estimate.parameters_as_work`). At the first ``train_step`` the
rank holding stage 0 has the mini-batch, so its first micro-batch is priced as ``sample_inputs`` would have
been (:func:`.default_cut.decide`). Then:

* a provisional cut (a convolution's even cut) is decided again by the group's first rank, which **times**
  each layer's forward + backward on that micro-batch (``partition="time"``'s profiler: the median of a
  layer's repeats, the fastest of three rounds; no count of FLOPs, bytes or operators prices a convolution's
  shape, :func:`stagewise.planning.defaults.pricing`), cuts by those times for the schedule, and hands the
  cut and its profile to every rank (:func:`.balance.on_first_rank`); where it differs, the pipeline moves to it
  with the live re-layout before the step runs (exact: the state moves, nothing has trained yet), and the cut
  is recorded as the run's own (``replanned_cut``: a checkpoint or snapshot records it, a resume built with
  ``"balanced"`` takes it back instead of deciding again); unless an optimizer of the user's, built over
  ``pipe.parameters()`` before the step, holds the parameters on some rank: the cut is then kept and rank 0
  says how to get the timed one (``sample_inputs=``, or ``optimizer=``, whose optimizers move with the cut);
* so is a transformers model's (``from_hf``): the parameters a decoder layer multiplies with
  (:func:`.default_cut.multiplied_parameters`) say nothing of its attention's work over the sequence's square,
  which a long sequence makes the larger part; its decoder layers are counted on that micro-batch on the ``meta``
  device (the embedding with the first, the head with the last) and the cut moved to as a convolution's is;
* dense layers keep their build-time cut (by parameters); their first micro-batch is counted on the ``meta``
  device (deterministic, nothing computed), and the named schedule is judged against 1F1B on those costs,
  with the link priced by a rough prior (:data:`stagewise.partition.estimate.LINKS`), and rank 0 gives the
  one-line word where it is predicted slower.

And, apart from the cut, wherever a RunCalibrator built before the first step asked (a pipeline cut without a
profile, by any partition): the layers, ``from_hf``'s decoder layers or ``from_model``'s blocks, priced as the
default cut prices them and handed to every rank as ``layer_profile``, the prior the run's calibration scales
(:func:`_prior`).

The cut's decision: only a pipeline on every rank of the world (no ``parallel=`` mesh, no smaller ``group=``): the
re-layout is a collective of the world. Any failure of the count is logged and the cut kept: the first step never
fails for its sake.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from ...partition.modes import DEFAULT
from ...schedules import is_asynchronous
from ..comm import collectives, groups
from ..engine.microbatch import split
from ..measure.profiling import model_blocks
from . import default_cut
from .balance import on_first_rank
from .layer_list import LayerList

log = logging.getLogger(__name__)


def pending(pipe: Any) -> bool:
    """Whether this pipeline's default cut waits for an input: the default partition, no sample inputs, no
    speeds or caps (a heterogeneous cut is not the default's), a synchronous schedule, ``Pipeline(layers)`` or
    ``Pipeline.from_hf`` on every rank of the world, untrained."""
    o = pipe.options
    # ``Pipeline(layers)`` (not HetPipe's workers, not a plan's layers) or ``from_hf``
    plain = isinstance(pipe.frontend, LayerList) and pipe.frontend.entry == LayerList.entry
    return (
        (plain or _stand_in(pipe.frontend))
        and pipe.schedule.num_ranks > 1
        and not is_asynchronous(pipe.schedule)
        and isinstance(o.partition, str)
        and o.partition == DEFAULT
        and o.sample_inputs is None
        and o.speeds is None
        and o.memory_caps is None
        and o.parallel is None
        and groups.group_size(pipe.transport.group) == groups.world_size()
        and pipe.train_steps == 0
        and getattr(pipe, "replanned_cut", None) is None
    )


def at_first_batch(pipe: Any, batches: list[tuple[Any, Any]]) -> None:
    """Before the first train step: the cut decided from the first micro-batch where it was provisional,
    and the word (module docstring); the layers priced for a calibrator that asked (:func:`_prior`). Every
    rank calls it alike (the decision is a collective when provisional, the pricing when asked for)."""
    if not batches:
        return
    wanted = pipe.prior_wanted  # (a re-layout below replaces the pipeline's fields)
    if pending(pipe):
        _default_cut(pipe, batches)
    if wanted:
        _prior(pipe, batches)


def _default_cut(pipe: Any, batches: list[tuple[Any, Any]]) -> None:
    named = _units(pipe) or []  # (pending: a layer list's layers or from_hf's decoder layers, never None)
    first = _first_microbatch(pipe, batches[0][0])
    if _stand_in(pipe.frontend) or default_cut.holds_convolution(named):
        default_cut.warn_if_slower(pipe.schedule, _recut(pipe, named, first), pipe.pp_rank, pipe.device.type)
    elif pipe.pp_rank == 0 and first is not None and pipe.schedule.name != "1f1b":  # the word only: no collective
        cut = _decide(pipe, named, first)
        here = default_cut.DefaultCut([len(r) for r in pipe.layer_ranges], cut.profile, cut.source)
        default_cut.warn_if_slower(pipe.schedule, here, 0, pipe.device.type)


def _recut(pipe: Any, named: Any, first: Any) -> default_cut.DefaultCut:
    """Rank 0's cut (timed: the list holds a convolution), taken by every rank (a re-layout) unless an
    optimizer of the user's holds the parameters; the cut that runs, with its profile (for the word)."""
    decided = default_cut.unplain(
        on_first_rank(
            pipe.transport.group,
            lambda: default_cut.plain(_decide(pipe, named, first)),
            "cutting the layers at the first batch (partition='balanced')",
            pipe.options.timeout,
            pipe.options.store,
        )
    )
    counts = [len(r) for r in pipe.layer_ranges]
    if decided.profile is not None and decided.counts != counts:
        if _anyone(pipe, _held_outside(pipe)):
            _keep(pipe, decided, counts)
            decided = default_cut.DefaultCut(counts, decided.profile, decided.source)
        else:
            log.info("stagewise: the first batch's %s work cuts the layers %s (was %s)", decided.source, decided.counts,
                     counts)  # fmt: skip
            pipe.relayout(partition=list(decided.counts))
            pipe.replanned_cut = list(decided.counts)  # recorded as the run's own: a resume takes it back
    if decided.profile is not None:  # the layers' costs as timed (what a calibration of the run scales)
        pipe.layer_profile = decided.profile
    return decided


def _prior(pipe: Any, batches: list[tuple[Any, Any]]) -> None:
    """The layers priced on the first micro-batch as the default cut prices them (counted on the ``meta``
    device; timed where a layer holds a convolution) by the group's first rank and handed to every rank, for a
    calibrator that asked (``prior_wanted``, set by :class:`~stagewise.runtime.calibration.from_run.RunCalibrator`
    built before the first step on a pipeline cut without a profile: a layer list, a transformers model's decoder
    layers or a model's blocks cut by hand, evenly or by parameters). The
    calibration spreads each stage's measured cost over its layers as this profile does; without it, evenly,
    which prices the blocks a stage gives up at the average of a stage that also holds a head (a live re-cut at
    a half-speed rank went one layer too far, 2026-12-04: docs/benchmarks/stragglers.md). Nothing
    fails the step for its sake: a layer that can be neither counted nor timed leaves the even spread."""
    pipe.prior_wanted = False
    named = _units(pipe)
    if pipe.layer_profile is not None or named is None:
        return

    def price() -> Any:
        try:
            first = _first_microbatch(pipe, batches[0][0])
            return default_cut.priced(named, first, seed=pipe.options.seed, device=pipe.device.type)[0]
        except Exception as err:  # (never the step's failure: the prior stays the even spread)
            log.info(
                "stagewise: the layers were not priced at the first batch (%s); calibrating on an even spread", err
            )
            return None

    what = "pricing the layers on the first batch for the run's calibration"
    pipe.layer_profile = on_first_rank(pipe.transport.group, price, what, pipe.options.timeout, pipe.options.store)


def _stand_in(frontend: Any) -> bool:
    """Whether the way in says its build's default cut is always a stand-in the first batch replaces (``from_hf``'s
    ``cut_at_first_batch``; a layer list's is only where it holds a convolution, :func:`_default_cut`)."""
    return bool(getattr(frontend, "cut_at_first_batch", False))


def _units(pipe: Any) -> list[tuple[str, Any]] | None:
    """What ``layer_ranges`` index, named: a layer list's layers, ``from_hf``'s decoder layers (the embedding with
    the first, the head with the last), or the top-level blocks ``from_model`` cut among (counted block to block,
    as its default cut counts them on ``sample_inputs``); None for anything else."""
    named = getattr(pipe.frontend, "named", None)
    if named is not None:
        return list(named)
    units = getattr(pipe.frontend, "units", None)  # (from_hf's)
    if callable(units):
        return list(units())
    cut, model = getattr(pipe, "model_cut", None), getattr(pipe.frontend, "model", None)
    if cut is None or model is None or not cut.blocks:  # (a tagged model: its stages' modules, not blocks)
        return None
    blocks = dict(model_blocks(model))
    return [(b, blocks[b]) for b in cut.blocks] if all(b in blocks for b in cut.blocks) else None


def _held_outside(pipe: Any) -> bool:
    """Whether an optimizer other than the pipeline's own holds one of its parameters (the README's
    ``torch.optim.AdamW(pipe.parameters())``): a re-layout would leave it holding tensors nobody trains (its next
    ``step()`` is refused), so the cut is then kept. Found among the live objects, once, at the first batch."""
    mine = {id(p) for p in pipe.parameters()}
    own = {id(o) for o in pipe.optimizers.values()}
    try:
        return any(
            issubclass(type(o), torch.optim.Optimizer)  # the real type: no object's __class__ is asked
            and id(o) not in own
            and any(id(p) in mine for g in o.param_groups for p in g["params"])
            for o in gc.get_objects()
        )
    except Exception as err:  # an object that cannot be asked: as if one were held (the cut is kept)
        log.debug("stagewise: could not look for optimizers of the user's (%s)", err)
        return True


def _anyone(pipe: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the pipeline (an all-gather, through the pipeline's guard)."""
    what = "whether an optimizer of the user's holds the pipeline's parameters"
    return any(collectives.gather_json(flag, pipe.transport.group, pipe.transport.guard.wait, what))


def _keep(pipe: Any, decided: default_cut.DefaultCut, counts: list[int]) -> None:
    if pipe.pp_rank == 0:
        log.info(
            "stagewise: the first batch's %s work would cut the layers %s; %s is kept, since an optimizer "
            "built over pipe.parameters() holds this cut's parameters: pass sample_inputs= (one micro-batch) to "
            "cut by it from the start, or optimizer= (a factory: its optimizers move with the cut)",
            decided.source,
            decided.counts,
            counts,
        )


def _decide(pipe: Any, named: Any, first: Any) -> default_cut.DefaultCut:
    """The default cut on this rank (the first rank's is the one used); the present cut when it cannot price."""
    counts = [len(r) for r in pipe.layer_ranges]
    if first is None:
        return default_cut.DefaultCut(counts, None, "parameters")
    try:
        return default_cut.decide(
            named, pipe.schedule, sample_inputs=first, speeds=None, seed=pipe.options.seed, device=pipe.device.type
        )
    except Exception as err:  # never fail the first step for an estimate
        log.info("stagewise: no counted cut at the first batch (%s); the cut stays %s", err, counts)
        return default_cut.DefaultCut(counts, None, "parameters")


def _first_microbatch(pipe: Any, inputs: Any) -> Any:
    """The first micro-batch of this rank's inputs (None where this rank has none: not stage 0's)."""
    if inputs is None:
        return None
    try:
        pieces, _ = split(inputs, pipe.schedule.num_microbatches, pipe.options.batch_dim)
    except (ValueError, TypeError) as err:  # the step itself will say what is wrong with the inputs
        log.debug("stagewise: no micro-batch to count (%s)", err)
        return None
    return pieces[0]
