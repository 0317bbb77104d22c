"""Each validator rule broken on purpose: the fast paths refuse what the reference refuses, rule by rule.

The rules are stated once, in :mod:`stagewise.validate.reference` (``RULES``: placement, completeness, local
order, optimizer steps, communication, progress); :mod:`stagewise.validate.fast` (the scan) and
:mod:`stagewise.validate.arrays` (whole arrays, progress by certificate) only decide. For every rule a
strategy edits a registered schedule so that it breaks that rule and none checked before it - the test
asserts the reference's first broken rule is that one, so every rule is reached - and then:

* the scan refuses it, and ``validate_schedule`` raises the reference's problems;
* where the array path applies (complete, not forward-only, two ranks or more) it proves nothing: not with a
  certificate that fits the edited schedule's batches (progress granted, so only the rule can refuse), not
  with the lowering's own, now stale, certificate, and not with numbers that respect every partner's wait
  but fall along a rank (what a check that forgot the rank order would accept from a schedule that hangs).

The version rules are stated in :mod:`stagewise.validate.versions` and decided by
:mod:`stagewise.validate.versions_fast`, rule by rule: each pair is compared on tables and orders that break
that rule, whether or not an earlier rule (the table) would have stopped the whole check first.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from helpers.certificates import fitting_certificate, partner_certificate
from stagewise.asynchronous import POLICIES, Version
from stagewise.ir import Action, ActionRows, Kind, Schedule, columns
from stagewise.passes import add_optimizer_steps, forward_only, lower
from stagewise.schedules import async_schedule, generate, schedule_info, schedule_names
from stagewise.validate import ScheduleError, validate_schedule, validate_versions, versions_fast
from stagewise.validate import versions as version_rules
from stagewise.validate.arrays import proves_valid
from stagewise.validate.fast import first_problem
from stagewise.validate.reference import RULES, broken_rule

COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
SENDS, RECVS = (Kind.SEND_F, Kind.SEND_B), (Kind.RECV_F, Kind.RECV_B)
RULE_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: a schedule broken on purpose, and the certificate the lowering gave it before the edit (None if not lowered)
Edited = tuple[Schedule, "list[list[int]] | None"]

#: how a registered schedule is turned into the one edited: compute-only or lowered, split, with optimizer steps,
#: forward-only (eval)
FORMS = ("compute", "compute-steps", "lowered", "split", "steps", "forward", "forward-compute")
COMPLETE = ("lowered", "split", "steps", "forward")


@st.composite
def registered(draw: st.DrawFn, forms: tuple[str, ...] = FORMS, min_ranks: int = 1) -> Schedule:
    """A registered synchronous schedule at a small size, in one of ``forms``; valid (checked)."""
    name = draw(st.sampled_from(schedule_names(synchronous=True)))
    info = schedule_info(name)
    p, m = draw(st.integers(min_ranks, 4)), draw(st.integers(1, 5))
    v = draw(st.sampled_from(info.virtual_stages or (1, 2, 3)))
    form = draw(st.sampled_from(forms))
    schedule = generate(name, p, m, v)
    if form == "compute-steps":
        schedule = add_optimizer_steps(schedule)
    elif form == "forward-compute":
        schedule = forward_only(schedule, validate=False)
    elif form != "compute":
        schedule = lower(schedule, split=form == "split", optimizer_steps=form == "steps", validate=False)
        if form == "forward":
            schedule = forward_only(schedule, validate=False)
    assert broken_rule(schedule) is None
    return schedule


def _edit(schedule: Schedule) -> list[list[Action]]:
    return [list(acts) for acts in schedule.ranks]


def _edited(schedule: Schedule, ranks: list[list[Action]]) -> Edited:
    return schedule.with_ranks(ranks), schedule.__dict__.get("_progress_certificate")


def _at(draw: st.DrawFn, ranks: list[list[Action]], kinds: tuple[Kind, ...]) -> tuple[int, int]:
    """(rank, index) of an action of one of ``kinds``, drawn."""
    where = [(r, j) for r, acts in enumerate(ranks) for j, a in enumerate(acts) if a.kind in kinds]
    return draw(st.sampled_from(where))


# ---- one strategy per rule: a valid schedule, edited to break that rule and none checked before it ----------------


@st.composite
def breaks_placement(draw: st.DrawFn) -> Edited:
    """An action moved to a rank that does not hold its stage, or given a stage or micro-batch out of range."""
    schedule = draw(registered())
    n, m, p = schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
    ranks = _edit(schedule)
    r, j = _at(draw, ranks, tuple(Kind))
    a = ranks[r][j]
    how = draw(st.sampled_from(["other rank", "stage", "micro-batch"]))
    if how == "other rank" and p > 1:
        other = ranks[(r + draw(st.integers(1, p - 1))) % p]
        other.insert(draw(st.integers(0, len(other))), ranks[r].pop(j))
    elif how == "micro-batch" and a.microbatch is not None:
        ranks[r][j] = Action(a.stage, a.kind, draw(st.sampled_from([-1, m, m + 1])))
    else:
        ranks[r][j] = Action(draw(st.sampled_from([-1, n, n + 1])), a.kind, a.microbatch)
    return _edited(schedule, ranks)


@st.composite
def breaks_completeness(draw: st.DrawFn) -> Edited:
    """A compute action deleted, repeated or turned into another kind; or a backward in an eval schedule."""
    schedule = draw(registered())
    ranks = _edit(schedule)
    r, j = _at(draw, ranks, COMPUTE)
    a = ranks[r][j]
    how = draw(st.sampled_from(["delete", "repeat", "kind", "backward"]))
    if how == "delete":
        del ranks[r][j]
    elif how == "repeat":
        ranks[r].insert(j + draw(st.integers(0, 1)), a)
    elif how == "kind":
        ranks[r][j] = Action(a.stage, draw(st.sampled_from([k for k in COMPUTE if k is not a.kind])), a.microbatch)
    else:  # one B more: a second backward, or any backward at all in an eval schedule
        ranks[r].insert(j + 1, Action(a.stage, Kind.B, a.microbatch))
    return _edited(schedule, ranks)


def _before_on_rank(schedule: Schedule, rank: int, a: Action) -> list[Action]:
    """The compute actions ``a`` must follow on its own rank: its forward (a backward), its I (a W), and the
    value it needs when the stage it comes from lives on this rank (data order)."""
    s, i, plc, n = a.stage, a.microbatch, schedule.placement, schedule.num_stages
    if a.kind is Kind.F:
        return [Action(s - 1, Kind.F, i)] if s > 0 and plc[s - 1] == rank else []
    if a.kind is Kind.W:
        return [Action(s, Kind.I, i)]
    needs = [Action(s, Kind.F, i)]
    if s < n - 1 and plc[s + 1] == rank:
        needs += [Action(s + 1, Kind.B, i), Action(s + 1, Kind.I, i)]
    return needs


@st.composite
def breaks_local_order(draw: st.DrawFn) -> Edited:
    """A compute action moved, on its rank, to somewhere before an action it must follow."""
    schedule = draw(registered(("compute", "compute-steps", "lowered", "split", "steps")))
    ranks = _edit(schedule)
    movable = []
    for r, acts in enumerate(ranks):
        index = {a: j for j, a in enumerate(acts)}
        for j, a in enumerate(acts):
            firsts = [index[b] for b in _before_on_rank(schedule, r, a) if b in index]
            if a.kind in COMPUTE and firsts:
                movable.append((r, j, min(firsts)))
    r, j, first = draw(st.sampled_from(movable))
    ranks[r].insert(draw(st.integers(0, first)), ranks[r].pop(j))
    return _edited(schedule, ranks)


@st.composite
def breaks_optimizer_steps(draw: st.DrawFn) -> Edited:
    """A STEP moved before its stage's compute or SYNC, deleted, repeated, or added to one stage only; a SYNC or
    a STEP in an eval schedule."""
    schedule = draw(registered())
    n = schedule.num_stages
    ranks = _edit(schedule)
    if schedule.meta.get("forward_only"):
        r = draw(st.integers(0, len(ranks) - 1))
        kind = draw(st.sampled_from([Kind.SYNC, Kind.STEP]))
        ranks[r].insert(draw(st.integers(0, len(ranks[r]))), Action(draw(st.sampled_from(schedule.stages_of(r))), kind))
        return _edited(schedule, ranks)
    steps = [(r, j) for r, acts in enumerate(ranks) for j, a in enumerate(acts) if a.kind is Kind.STEP]
    if not steps:  # one stage steps and the others do not (a lone stage steps twice)
        r = draw(st.integers(0, len(ranks) - 1))
        stage = draw(st.sampled_from(schedule.stages_of(r)))
        ranks[r] += [Action(stage, Kind.STEP)] * (1 if n > 1 else 2)
        return _edited(schedule, ranks)
    r, j = draw(st.sampled_from(steps))
    step = ranks[r][j]
    how = draw(st.sampled_from(["early", "delete", "repeat"] if n > 1 else ["early", "repeat"]))
    if how == "delete":
        del ranks[r][j]
    elif how == "repeat":
        ranks[r].insert(j + draw(st.integers(0, 1)), step)
    else:
        last = max(
            k for k, a in enumerate(ranks[r]) if a.stage == step.stage and (a.kind in COMPUTE or a.kind is Kind.SYNC)
        )
        ranks[r].insert(draw(st.integers(0, last)), ranks[r].pop(j))
    return _edited(schedule, ranks)


@st.composite
def breaks_gradient_syncs(draw: st.DrawFn) -> Edited:
    """A SYNC moved before one of its stage's B or W (the gradients it reduces are not final yet), deleted from
    one stage while the others keep theirs, or repeated."""
    schedule = draw(registered(forms=("lowered", "split", "steps")))
    ranks = _edit(schedule)
    syncs = [(r, j) for r, acts in enumerate(ranks) for j, a in enumerate(acts) if a.kind is Kind.SYNC]
    r, j = draw(st.sampled_from(syncs))
    sync = ranks[r][j]
    how = draw(st.sampled_from(["early", "delete", "repeat"] if schedule.num_stages > 1 else ["early", "repeat"]))
    if how == "delete":
        del ranks[r][j]
    elif how == "repeat":
        ranks[r].insert(j + draw(st.integers(0, 1)), sync)
    else:
        last = max(k for k, a in enumerate(ranks[r]) if a.stage == sync.stage and a.kind in (Kind.B, Kind.W))
        ranks[r].insert(draw(st.integers(0, last)), ranks[r].pop(j))
    return _edited(schedule, ranks)


def _channel(schedule: Schedule, a: Action) -> tuple[str, int, int]:
    """The direction and the (sender, receiver) ranks of a communication action's message."""
    plc, s = schedule.placement, a.stage
    if a.kind is Kind.SEND_F:
        return "send", plc[s], plc[s + 1]
    if a.kind is Kind.SEND_B:
        return "send", plc[s], plc[s - 1]
    if a.kind is Kind.RECV_F:
        return "recv", plc[s - 1], plc[s]
    return "recv", plc[s + 1], plc[s]


def _produced_or_used_at(acts: list[Action], a: Action) -> int:
    """Where, on its rank, the value a send sends is made, or the value a receive receives is used."""
    s, i = a.stage, a.microbatch
    if a.kind is Kind.SEND_F or a.kind is Kind.RECV_F:
        wanted = {Action(s, Kind.F, i)}
    else:
        wanted = {Action(s, Kind.B, i), Action(s, Kind.I, i)}
    return next(k for k, b in enumerate(acts) if b in wanted)


@st.composite
def breaks_communication(draw: st.DrawFn) -> Edited:
    """A send or receive deleted or repeated, a receive moved after its use or a send before its making, or a
    receive moved before the previous one from the same sender (the channel's order)."""
    schedule = draw(registered(COMPLETE, min_ranks=2))
    ranks = _edit(schedule)
    r, j = _at(draw, ranks, SENDS + RECVS)
    acts, a = ranks[r], ranks[r][j]
    how = draw(st.sampled_from(["delete", "repeat", "out of order", "channel order"]))
    same_channel = [
        k for k in range(j) if acts[k].kind in SENDS + RECVS and _channel(schedule, acts[k]) == _channel(schedule, a)
    ]
    if how == "channel order" and same_channel:
        acts.insert(same_channel[-1], acts.pop(j))
    elif how == "out of order":
        k = _produced_or_used_at(acts, a)
        acts.pop(j)
        if a.kind in RECVS:  # after its use (at k, after j)
            acts.insert(draw(st.integers(k, len(acts))), a)
        else:  # before its making (at k, before j)
            acts.insert(draw(st.integers(0, k)), a)
    elif how == "repeat":
        acts.insert(j + draw(st.integers(0, 1)), a)
    else:
        del acts[j]
    return _edited(schedule, ranks)


@st.composite
def breaks_progress(draw: st.DrawFn) -> Edited:
    """Edits that can hang the ranks and keep the other rules: on a complete schedule a receive moved earlier or
    a send later (never past another op of its channel, so never past the action it serves); on a compute-only
    one, a compute action moved. The first edit whose first broken rule is progress is kept."""
    schedule = draw(registered(("compute", "lowered", "split", "steps", "forward"), min_ranks=2))
    rnd = draw(st.randoms(use_true_random=False))
    for _ in range(60):
        ranks = _edit(schedule)
        r = rnd.randrange(len(ranks))
        acts = ranks[r]
        if schedule.is_complete:
            ops = [j for j, a in enumerate(acts) if a.kind in SENDS + RECVS]
            j = rnd.choice(ops)
            a = acts[j]
            same = [k for k in ops if _channel(schedule, acts[k]) == _channel(schedule, a)]
            if a.kind in RECVS:
                lo = max([k + 1 for k in same if k < j], default=0)
                to = rnd.randint(lo, j)
            else:
                hi = min([k - 1 for k in same if k > j], default=len(acts) - 1)
                to = rnd.randint(j, hi)
        else:
            j, to = rnd.randrange(len(acts)), rnd.randrange(len(acts))
        acts.insert(to, acts.pop(j))
        found = broken_rule(schedule.with_ranks(ranks))
        if found is not None and found[0] == "progress":
            return _edited(schedule, ranks)
    reject()  # no hang found near this schedule: try another


# ---- the check, the same for every rule --------------------------------------------------------------------------


def _refused_by_every_path(edited: Schedule, rule: str, stale: list[list[int]] | None) -> None:
    found = broken_rule(edited)
    assert found is not None and found[0] == rule, (found, edited.to_text())
    assert first_problem(edited) is not None, f"the scan accepts a schedule that breaks {rule}:\n{edited.to_text()}"
    with pytest.raises(ScheduleError) as error:
        validate_schedule(edited)
    assert error.value.problems == found[1]
    if not edited.is_complete or edited.num_ranks < 2 or edited.meta.get("forward_only"):
        event("the scan decides alone")
        return  # the array path answers "not proved" without looking
    fitting = fitting_certificate(edited)
    event("the array path, with a fitting certificate" if fitting else "the array path, progress not certifiable")
    for certificate in (fitting, stale, partner_certificate(edited)):
        if certificate is not None:
            assert not proves_valid(edited, certificate), f"the array path proves {rule} broken valid"
    attached = edited.with_ranks(edited.ranks)
    object.__setattr__(attached, "_progress_certificate", fitting or stale)
    assert first_problem(attached) is not None  # through the door: the certificate is tried first


@RULE_SETTINGS
@given(breaks_placement())
def test_broken_placement_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "placement", edited[1])


@RULE_SETTINGS
@given(breaks_completeness())
def test_broken_completeness_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "completeness", edited[1])


@RULE_SETTINGS
@given(breaks_local_order())
def test_broken_local_order_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "local order", edited[1])


@RULE_SETTINGS
@given(breaks_optimizer_steps())
def test_broken_optimizer_steps_are_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "optimizer steps", edited[1])


@RULE_SETTINGS
@given(breaks_gradient_syncs())
def test_a_gradient_sync_before_its_stages_last_backward_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "optimizer steps", edited[1])


@RULE_SETTINGS
@given(breaks_communication())
def test_broken_communication_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "communication", edited[1])


@RULE_SETTINGS
@given(breaks_progress())
def test_a_hang_is_refused_by_every_path(edited: Edited) -> None:
    _refused_by_every_path(edited[0], "progress", edited[1])


def test_the_door_states_each_rule_once_in_the_order_they_are_checked() -> None:
    import stagewise.validate as door

    names = [name for name, _ in RULES]
    assert names == ["placement", "completeness", "local order", "optimizer steps", "communication", "progress"]
    doc = door.__doc__ or ""
    assert all(doc.count(f"**{name}**") == 1 for name in names), doc
    assert [doc.index(f"**{name}**") for name in names] == sorted(doc.index(f"**{name}**") for name in names)


# ---- the version rules: each reporting check of validate.versions against its decision in versions_fast ----------

VARIANTS = [
    ("pipedream", {}),  # stash
    ("pipedream", {"stashing": False}),  # none
    ("pipedream", {"vertical_sync": True}),  # vertical
    ("pipedream-2bw", {}),  # 2bw
    ("xpipe", {}),  # predict
]
#: the version rules, in the order validate_versions checks them: (name, reporting check, fast decision)
VERSION_RULES = [
    ("shape", version_rules._shape, versions_fast._shape),
    ("table", version_rules._table_matches, versions_fast._table),
    ("policy and existence", version_rules._rules, versions_fast._rules),
    ("bounds", version_rules._bounds, versions_fast._bounds),
]


@st.composite
def asynchronous(draw: st.DrawFn) -> Schedule:
    name, opts = draw(st.sampled_from(VARIANTS))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(max(1, p - 1) if name == "pipedream-2bw" else 1, 3))
    return async_schedule(name, p, draw(st.integers(1, 4)), m, **opts)


def _retabled(schedule: Schedule, ranks: list[list[Action]] | None = None, **table: object) -> Schedule:
    """``schedule`` with other action lists and table fields (its own where not given), as lists of actions."""
    old = schedule.meta["versions"]
    acts = tuple(map(tuple, ranks if ranks is not None else schedule.ranks))
    new = dataclasses.replace(old, **table)  # type: ignore[arg-type]
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, acts, {"versions": new})


def _as_columns(schedule: Schedule) -> Schedule:
    """The same schedule with its actions as columns (what generators and the lowering hand over)."""
    cols = columns(schedule)
    assert cols is not None
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ActionRows(cols), schedule.meta)


def _version_rule_refused(edited: Schedule, rule: str) -> None:
    """The reporting check of ``rule`` names a problem; its fast decision, on lists and on columns, refuses too;
    the rules before it hold in both (so the whole check reaches it only when the table does not stop it)."""
    table = edited.meta["versions"]
    names = [name for name, _, _ in VERSION_RULES]
    for name, report, decide in VERSION_RULES[: names.index(rule) + 1]:
        problems = report(edited, table)
        for form in (edited, _as_columns(edited)):
            verdict = decide(form, table)
            assert (verdict is None) == (not problems), (name, verdict, problems[:3])
        assert bool(problems) == (name == rule), (name, problems[:3])
    assert versions_fast.first_version_problem(edited, table) is not None
    with pytest.raises(ScheduleError):
        validate_versions(edited)


@RULE_SETTINGS
@given(asynchronous(), st.data())
def test_broken_version_shape_is_refused_by_both_checks(schedule: Schedule, data: st.DataObject) -> None:
    """A STEP moved before the last backward of its mini-batch, dropped or repeated; a backward split into I, W."""
    table = schedule.meta["versions"]
    m = table.microbatches
    ranks = _edit(schedule)
    r, j = _at(data.draw, ranks, (Kind.STEP,))
    acts, step = ranks[r], ranks[r][j]
    how = data.draw(st.sampled_from(["early", "drop", "repeat", "split"]))
    if how == "early":
        k = sum(1 for a in acts[:j] if a.kind is Kind.STEP)  # STEP k applies mini-batch k
        last = max(x for x, a in enumerate(acts) if a.kind is Kind.B and k * m <= a.microbatch < (k + 1) * m)
        acts.insert(data.draw(st.integers(0, last)), acts.pop(j))
    elif how == "drop":
        del acts[j]
    elif how == "repeat":
        acts.insert(j, step)
    else:
        b = data.draw(st.sampled_from([x for x, a in enumerate(acts) if a.kind is Kind.B]))
        a = acts[b]
        acts[b : b + 1] = [Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]
    _version_rule_refused(_retabled(schedule, ranks), "shape")


@RULE_SETTINGS
@given(asynchronous(), st.data())
def test_a_table_not_the_policys_is_refused_by_both_checks(schedule: Schedule, data: st.DataObject) -> None:
    """One entry of the table moved to another version: not the table the policy gives for this order."""
    table = schedule.meta["versions"]
    which = data.draw(st.sampled_from(["forward", "backward"]))
    rows = [list(row) for row in getattr(table, which)]
    s = data.draw(st.integers(0, len(rows) - 1))
    i = data.draw(st.integers(0, len(rows[s]) - 1))
    old = rows[s][i]
    rows[s][i] = data.draw(st.sampled_from([Version(old.base + 1, old.ahead), Version(old.base, old.ahead + 1)]))
    _version_rule_refused(_retabled(schedule, **{which: tuple(map(tuple, rows))}), "table")


@RULE_SETTINGS
@given(asynchronous(), st.data())
def test_broken_policy_or_existence_is_refused_by_both_checks(schedule: Schedule, data: st.DataObject) -> None:
    """Entries edited to break the policy's own rule or to use a version not made yet: a backward on another
    version than its forward (every policy but none), a version from the future (any), a mini-batch of
    predictions made from other weights than the current ones (predict). The table check alone would stop these
    first; the rule check is compared on them directly."""
    table = schedule.meta["versions"]
    m, n_mb = table.microbatches, table.minibatches
    fwd, bwd = [list(row) for row in table.forward], [list(row) for row in table.backward]
    entries = [(s, i) for s in range(len(fwd)) for i in range(len(fwd[s]))]
    predicted = [(s, i) for s, i in entries if i % m == 0 and fwd[s][i].ahead and fwd[s][i].base > 0]
    hows = ["future"] + (["differ"] if table.policy != "none" else []) + (["prediction"] if predicted else [])
    how = data.draw(st.sampled_from(hows))
    event(f"{table.policy}: {how}")
    s, i = data.draw(st.sampled_from(predicted if how == "prediction" else entries))
    if how == "differ":
        f = fwd[s][i]
        bwd[s][i] = data.draw(st.sampled_from([Version(f.base + 1, f.ahead), Version(f.base, f.ahead + 1)]))
    elif how == "future":
        fwd[s][i] = bwd[s][i] = Version(n_mb + 1)
    else:  # the whole mini-batch predicts from the weights before the current ones
        v = fwd[s][i]
        for k in range(i, i + m):
            fwd[s][k] = bwd[s][k] = Version(v.base - 1, v.ahead)
    edited = _retabled(schedule, forward=tuple(map(tuple, fwd)), backward=tuple(map(tuple, bwd)))
    table = edited.meta["versions"]
    problems = version_rules._rules(edited, table)
    assert problems
    for form in (edited, _as_columns(edited)):
        assert versions_fast._rules(form, table) is not None
    assert versions_fast.first_version_problem(edited, table) is not None


def test_a_prediction_from_stale_weights_is_refused_by_both_checks() -> None:
    """Every mini-batch XPipe predicts for (at every size here), predicted from the weights before the current
    ones instead: only the prediction rule breaks, and both checks say so."""
    edits = 0
    for p in (2, 3, 4):
        for m in (1, 2):
            schedule = async_schedule("xpipe", p, 3, m)
            table = schedule.meta["versions"]
            for s, row in enumerate(table.forward):
                for i in range(0, len(row), m):
                    if not (row[i].ahead and row[i].base > 0):
                        continue
                    fwd, bwd = [list(r) for r in table.forward], [list(r) for r in table.backward]
                    for k in range(i, i + m):
                        fwd[s][k] = bwd[s][k] = Version(row[i].base - 1, row[i].ahead)
                    edited = _retabled(schedule, forward=tuple(map(tuple, fwd)), backward=tuple(map(tuple, bwd)))
                    new = edited.meta["versions"]
                    problems = version_rules._rules(edited, new)
                    assert problems and all("prediction" in x for x in problems), problems
                    assert versions_fast._rules(edited, new) is not None
                    assert versions_fast._rules(_as_columns(edited), new) is not None
                    edits += 1
    assert edits


def test_both_bound_checks_agree_and_some_relabels_break_the_bound() -> None:
    """Each table relabelled with every policy's name: the memory bound's reporting check and its decision agree,
    and some relabels break it (a PipeDream table read as 2BW keeps more versions than 2BW allows)."""
    broken = []
    for name, opts in VARIANTS:
        for p in (2, 3, 4):
            for m in (max(1, p - 1), p) if name == "pipedream-2bw" else (1, 2, 3):
                schedule = async_schedule(name, p, 4, m, **opts)
                for policy in POLICIES:
                    edited = _retabled(schedule, policy=policy)
                    table = edited.meta["versions"]
                    problems = version_rules._bounds(edited, table)
                    for form in (edited, _as_columns(edited)):
                        assert (versions_fast._bounds(form, table) is None) == (not problems), (policy, problems)
                    if problems:
                        broken.append((name, schedule.meta["versions"].policy, policy))
    assert ("pipedream", "stash", "2bw") in broken
