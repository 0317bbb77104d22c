"""The validator: a schedule computes every gradient once and cannot deadlock; asynchronous ones keep their
weight-version rules.

One door, :func:`validate_schedule` (:mod:`.schedules`; and :func:`validate_versions` for asynchronous
schedules). Each rule is stated once, as a check that names every problem it finds (the rank, the action,
its neighbours); the fast paths only decide "valid or not", and when they refuse, the door runs the stated
checks, so every :class:`ScheduleError` carries their words.

The rules of every schedule, stated in :mod:`.reference` (``RULES``, checked in this order):

1. **placement**: every action runs on the rank that holds its stage; stages and micro-batches in range;
2. **completeness**: each (stage, micro-batch) has exactly one F and one backward (a B, or an I and a W);
   a forward-only (eval) schedule, ``meta["forward_only"]``, has one F each and no backward;
3. **local order**: on a rank, a backward after its own F, a W after its I, and across two stages held by
   the same rank, data order (F of s-1 before F of s, the backward of s+1 before that of s);
4. **optimizer steps**: a schedule with STEP actions steps each stage exactly once, after all of the
   stage's compute and its SYNC; one with SYNC actions syncs each stage exactly once, after all of its B and
   W (its gradients final); a forward-only one has neither SYNC nor STEP (an asynchronous one has a SYNC and
   a STEP per mini-batch, which the version rules check);
5. **communication** (complete schedules): every value crossing ranks is sent once after it is made and
   received once before it is used, and on each (sender, receiver) channel the k-th send is the k-th
   receive;
6. **progress**: the ranks run together finish. A complete schedule runs with *blocking* point-to-point:
   each maximal run of communication actions is posted as one batch (as ``batch_isend_irecv`` does) that
   completes once every operation in it has met its partner; a compute-only one runs as pure data flow.

Two fast paths decide them, neither derived mechanically from the statements, so each is checked against
them by property tests:

* :mod:`.fast`, one scan per rank on flat integers (every rule; progress by running the rendezvous), and
* :mod:`.arrays`, whole-array checks of a complete schedule with progress proved by the lowering's
  certificate (it says "proved valid" or "not proved"; the scan decides the rest).

tests/core/test_validator_rules.py breaks each rule on purpose (and no rule checked before it) on every
registered schedule form: the scan refuses, and the array path proves nothing, even given a certificate
that fits. tests/core/test_validate_fast.py gives valid schedules and random edits of them to all three and
asks for the same verdict.

The version rules of an asynchronous schedule (``meta["versions"]``, a version table), stated in
:mod:`.versions` (reporting checks, in this order) and decided by :mod:`.versions_fast`, rule for rule:

1. **shape**: one stage per rank, one STEP per mini-batch and stage, STEP k after the last backward of
   mini-batch k, no I/W split (a split backward has no single version to differentiate);
2. **table**: the table is the one the policy gives for this action order;
3. **policy and existence**: the policy's own rule (``stash``, ``vertical``, ``2bw``, ``predict``: a
   backward differentiates its forward's version; ``vertical``: every stage uses the version stage 0 tagged;
   ``2bw``, ``predict``: the micro-batches of a mini-batch share one version), and each version used is
   made by then (a prediction from the current weights);
4. **bounds**: a stage never keeps more live versions than the policy's bound
   (:func:`stagewise.asynchronous.versions.version_bound`).

tests/core/test_validator_rules.py compares each reporting check with its decision on tables and orders
that break that rule (on action lists and on columns); tests/core/test_versions_fast.py compares the whole
verdicts on random edits.
"""

from .schedules import ScheduleError, dataflow_problems, validate_reference, validate_schedule
from .versions import async_table, validate_versions

__all__ = [
    "ScheduleError",
    "async_table",
    "dataflow_problems",
    "validate_reference",
    "validate_schedule",
    "validate_versions",
]
