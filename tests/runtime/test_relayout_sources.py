"""A recovery's sources (runtime/relayout/sources.py), pure: the committed step, live tensors taken only at it,
and for every name its own live tensor, another survivor's, or a snapshot file a survivor holds."""

from __future__ import annotations

import random
from typing import Any

from stagewise.runtime.elastic.choose import Need
from stagewise.runtime.relayout import keys as K
from stagewise.runtime.relayout.sources import Decision, Take, clean_names, decide, plan_sources

LAYOUT = {"world": 2}
A, B, BN = "model/a.weight", "model/b.weight", "model/bn.running_mean"


def copy(machine: str, holder: int, owner: int, step: int, names: list[str], job: str = "j") -> dict[str, Any]:
    """A listed snapshot file (the fields the take-over's listing sends)."""
    return {
        "machine": machine,
        "holder": holder,
        "path": f"/{machine}/{step}-r{owner}",
        "lineage": "L",
        "step": step,
        "owner": owner,
        "world": 4,
        "layout": {"world": 4},
        "names": names,
        "job": job,
    }


def record(machine: str, need: list[str] | None, live: dict[str, list[str]], copies: list[Any]) -> dict[str, Any]:
    return {"machine": machine, "copies": copies, "ended": {}, "need": need, "live": live}


def files(step: int) -> tuple[list[Any], list[Any]]:
    """Four owners' files of ``step``: owners 0, 2 on machine m0 (listed by process 0) and 1, 3 on m1 (by 1)."""
    m0 = [copy("m0", 0, o, step, [n]) for o, n in ((0, A), (2, BN))]
    m1 = [copy("m1", 1, o, step, [n]) for o, n in ((1, B), (3, "param:b.weight"))]
    return m0, m1


def test_own_live_is_kept_anothers_is_moved_the_lost_stage_comes_from_a_file() -> None:
    m0, m1 = files(4)
    everyone = [
        record("m0", [A, B], {"4": [A]}, m0),
        record("m1", [BN, "param:b.weight"], {"4": [B]}, m1),
    ]
    d = decide(everyone, LAYOUT, None)
    assert not isinstance(d, str), d
    assert d.step == 4 and d.kept == {0: (A,), 1: ()}
    assert d.takes == (
        Take(B, 0, 1),  # another survivor's live tensor, moved
        Take(BN, 1, 0, "/m0/4-r2", "m0"),  # only on machine m0: read there by its lister, sent
        Take("param:b.weight", 1, 1, "/m1/4-r3", "m1"),  # on the receiver's machine: read where it is needed
    )
    assert d.counts() == {"kept": 1, "live": 1, "snapshot": 2}
    assert d.reads(0) == [("m0", "/m0/4-r2")] and d.reads(1) == [("m1", "/m1/4-r3")]


def test_a_survivor_past_the_committed_step_gives_nothing_live() -> None:
    """Step 5's files are not whole (owner 3's is missing: it died first), so step 4 is committed; the
    survivors' live tensors are step 5's (marked clean at 5 only): everything comes from step 4's files."""
    m0, m1 = files(4)
    n0, n1 = files(5)
    everyone = [
        record("m0", [A, B], {"4": [], "5": [A, B]}, m0 + n0),
        record("m1", [BN, "param:b.weight"], {"4": [], "5": [B]}, m1 + n1[:1]),
    ]
    d = decide(everyone, LAYOUT, None)
    assert not isinstance(d, str), d
    assert d.step == 4 and d.counts() == {"kept": 0, "live": 0, "snapshot": 4}
    assert {t.path for t in d.takes} == {"/m0/4-r0", "/m1/4-r1", "/m0/4-r2", "/m1/4-r3"}


def test_a_newcomer_contributes_nothing_and_receives_everything() -> None:
    m0, m1 = files(4)
    everyone = [
        record("m0", [A], {"4": [A, B]}, m0),
        record("m1", [BN, "param:b.weight"], {"4": [B]}, m1),
        record("m2", [A, B], {}, []),  # the newcomer: no old state, no files
    ]
    d = decide(everyone, LAYOUT, None)
    assert not isinstance(d, str), d
    got = [t for t in d.takes if t.dst == 2]
    assert got == [Take(A, 2, 0), Take(B, 2, 0)]  # the lowest survivor holding each live


def test_refusals_are_the_same_reasons_on_every_process() -> None:
    m0, m1 = files(4)
    everyone = [record("m0", [A, B], {"4": [A]}, m0), record("m1", [BN], {}, m1)]
    assert "newer" in str(decide(everyone, LAYOUT, 8))  # a checkpoint on disk after the snapshots
    tie = decide(everyone, LAYOUT, 4)  # one of the committed step: a tie goes to memory (the resume's rule)
    assert not isinstance(tie, str) and tie.step == 4 and tie.kept[0] == (A,), tie
    assert "covers" in str(decide([record("m0", ["model/z"], {}, m0)], LAYOUT, None))
    alone = copy("m0", 0, 0, 4, [A]) | {"world": 1, "layout": {"world": 1}}
    same = decide([record("m0", [A], {"4": [A]}, [alone])], {"world": 1}, None)
    assert "generators" in str(same)  # the layout that saved: the resume restores the generators' states
    ended = [dict(e, ended={"j": 4}) for e in everyone]
    assert "covers" in str(decide(ended, LAYOUT, None))  # a finished job's files are never taken


def test_clean_names_need_the_parameter_and_all_of_its_optimizer_state_unchanged() -> None:
    captured = {A: 3, B: 3, "optim/a.weight/exp_avg": 1, "optim/a.weight/step": 1, "optim/b.weight/exp_avg": 1}
    now = dict(captured, **{"optim/b.weight/exp_avg": 2})  # b's optimizer state stepped since
    assert clean_names(captured, now, ["a.weight", "b.weight"]) == {A, B, "param:a.weight"}
    stepped = dict(now, **{A: 4})  # a's parameter written since: neither it nor its state counts
    assert clean_names(captured, stepped, ["a.weight", "b.weight"]) == {B}
    assert clean_names({A: 1}, {A: 1, "optim/a.weight/step": 0}, ["a.weight"]) == {A}  # state came since
    assert clean_names({A: 1}, {A: 1}, ["a.weight"]) == {A, "param:a.weight"}  # never stepped: no state


def test_a_relayout_and_a_take_over_pick_the_same_live_sources() -> None:
    """One rule (``live_source``) for both: over random holdings, the re-layout's key plan and the take-over's
    plan keep, send and receive the same names between the same processes."""
    names = [f"model/t{i}" for i in range(12)]
    for seed in range(20):
        rng = random.Random(seed)
        world = rng.randint(1, 5)
        held = [sorted(n for n in names if rng.random() < 0.4) for _ in range(world)]
        owned = set().union(*map(set, held))
        needed = [sorted(n for n in owned if rng.random() < 0.5) for _ in range(world)]
        decision = Decision(0, "L", "j")
        needs = [Need(r, "m", frozenset(needed[r])) for r in range(world)]
        assert plan_sources(decision, needs, {r: frozenset(held[r]) for r in range(world)}, []) == []
        lists = [[[K.key(n) for n in held[r]], [], [K.key(n) for n in needed[r]], []] for r in range(world)]
        by_key = {K.key(n): n for n in names}
        for r in range(world):
            part = K.plan(lists, r)
            assert [by_key[k] for _, k in part.kept] == sorted(decision.kept[r], key=K.key)
            got = {(by_key[k], src) for src, items in part.receives.items() for _, k in items}
            assert got == {(t.name, t.src) for t in decision.takes if t.dst == r}, seed
            sent = {(by_key[k], dst) for dst, items in part.sends.items() for _, k in items}
            assert sent == {(t.name, t.dst) for t in decision.takes if t.src == r}, seed


def test_a_relayout_and_a_take_over_pick_the_same_snapshot_files() -> None:
    """The fallback too: over random holdings, machines and files, the key plan with the files listed takes each
    name no process holds live from the same file, read by the same process, as the take-over's plan."""
    names = [f"model/t{i}" for i in range(12)]
    for seed in range(30):
        rng = random.Random(seed)
        world = rng.randint(1, 5)
        machines = [rng.choice("ab") for _ in range(world)]
        held = [sorted(n for n in names if rng.random() < 0.2) for _ in range(world)]
        files = []
        for owner in range(rng.randint(0, 4)):
            holder = rng.randrange(world)
            in_file = sorted(n for n in names if rng.random() < 0.5)
            files.append(_file(machines[holder], holder, owner, in_file))
        findable = set().union(*map(set, held), *(c.names for c in files))
        needed = [sorted(n for n in findable if rng.random() < 0.5) for _ in range(world)]
        decision = Decision(0, "L", "j")
        needs = [Need(r, machines[r], frozenset(needed[r])) for r in range(world)]
        assert plan_sources(decision, needs, {r: frozenset(held[r]) for r in range(world)}, files) == []
        lists = [[[K.key(n) for n in held[r]], [], [K.key(n) for n in needed[r]], []] for r in range(world)]
        filed = [
            K.Filed(c.machine, c.holder, c.owner, c.path, frozenset((K.MODEL, K.key(n)) for n in c.names))
            for c in files
        ]
        by_key = {K.key(n): n for n in names}
        for r in range(world):
            part = K.plan(lists, r, filed, machines)
            assert part.lost == ()
            got = {(by_key[k], src) for src, items in part.receives.items() for _, k in items}
            got |= {(by_key[k], r) for _, k in part.read}
            assert got == {(t.name, t.src) for t in decision.takes if t.dst == r}, seed
            sent = {
                (by_key[k], dst, part.filed.get((dst, (kind, k))))
                for dst, items in part.sends.items()
                for kind, k in items
            }
            sent |= {(by_key[k], r, part.filed[(r, (kind, k))]) for kind, k in part.read}
            assert sent == {(t.name, t.dst, t.path) for t in decision.takes if t.src == r}, seed


def _file(machine: str, holder: int, owner: int, names: list[str]) -> Any:
    from stagewise.runtime.relayout.sources import as_copy

    return as_copy({**copy(machine, holder, owner, 1, names), "path": f"/{machine}/{holder}-r{owner}"})


def test_the_take_overs_progress_is_the_committed_generations_report() -> None:
    """Step 5 is not whole, step 4 is committed: the progress restored is step 4's (its files' headers), not the
    newer step 5's a survivor also listed."""
    m0, m1 = files(4)
    n0, _ = files(5)
    everyone = [
        {**record("m0", [A, B], {}, m0 + n0), "progress": {"4/L": ["drop4", "lr4"], "5/L": ["drop5", "lr5"]}},
        {**record("m1", [BN, "param:b.weight"], {}, m1), "progress": {"4/L": ["drop4", "lr4"]}},
    ]
    d = decide(everyone, LAYOUT, None)
    assert not isinstance(d, str), d
    assert d.step == 4 and d.progress == ["drop4", "lr4"]
