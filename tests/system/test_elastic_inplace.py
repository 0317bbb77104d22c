"""An in-place elastic job (``sw.runtime.InPlace``): a machine is lost and the survivors keep their processes.

Machines are processes of one host (tests/system/scripts/inplace_machines.py; no root), meeting on the store
of ``stagewise rendezvous``; the job is tests/system/scripts/elastic_inplace.py (float64, ``snapshot=1``):

* two machines lost, one between steps, one in the middle of a step (the others inside it): the survivors
  stay in their processes (the same pids before and after), agree on each generation, go on from the
  committed step (none rolled back; the step in flight redone at the new layout), and their losses from
  there equal, bit for bit, those of a fresh job of the new size resumed from the state they went on from;
  threads and descriptors after the second fault are no more than after the first;
* a machine cut off right after a step, before its snapshot's copy left: that step was never reported committed,
  and the survivors go back to the committed step before it (nothing committed rolled back);
* a SIGSTOPped machine: the survivors go on without it; woken, it finds itself behind the job's generation
  and leaves (exit status 3) without writing a snapshot or a loss into the new generation.

* a machine taken back (its memory folder removed: a spare with nothing), started directly or with
  ``stagewise run --in-place``: it takes a fresh id, asks to join, and the members take it in between steps
  without restarting (the same pids); every member, the newcomer too, goes on from the committed step, and the
  losses equal a fresh job of the new size resumed from that state, bit for bit;

* pipelines (``--layout stages``: pp = the world, dp 1; ``--layout pp2``: ElasticLayout(pp=2), 2 processes
  per machine): a lost machine's stages (for ``stages`` the only live copy) come back from the copy on the
  next machine (its own memory folder removed), the survivors cut the model again, and their losses equal a
  fresh job of the new size resumed from the state the old layout saved at the committed step.

Events and their order, never times. ``make elastic`` (``STAGEWISE_ELASTIC=1``): each job takes 1-3 minutes
on a loaded machine.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from inplace_machines import Machines

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not os.environ.get("STAGEWISE_ELASTIC"), reason="in-place elastic jobs: `make elastic`"),
]


@pytest.fixture
def machines(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Machines]:
    made = Machines(tmp_path / "job", request.param, job=f"t{os.getpid()}")
    yield made
    made.close()


def _events(m: Machines, what: str) -> list[dict[str, object]]:
    return [e for e in m.rows("events.jsonl") if e["what"] == what]


@pytest.mark.parametrize("machines", [4], indirect=True)
def test_two_lost_machines_the_survivors_keep_their_processes_and_their_losses_are_a_fresh_jobs(
    machines: Machines, tmp_path: Path
) -> None:
    m = machines
    m.start(["--hold", "3", "--steps", "8", "--save-resumed", "--die", "2:6", "--settle", "12"])
    m.wait_for("hold-*", 4)
    m.lose(3)  # between steps 3 and 4
    m.lost.add(2)  # (it kills itself as step 6 starts: the survivors are inside step 6)
    (m.out / "go").touch()
    assert m.wait(0) == [0] and m.wait(1) == [0], m.text(0)[-3000:] + m.text(1)[-3000:]
    started = {e["id"]: e["pid"] for e in _events(m, "started")}
    recovered = _events(m, "recovered")
    finished = _events(m, "finished")
    assert sorted((e["id"], e["gen"], e["members"]) for e in recovered) == [
        (0, 1, [0, 1, 2]), (0, 2, [0, 1]), (1, 1, [0, 1, 2]), (1, 2, [0, 1]), (2, 1, [0, 1, 2]),
    ]  # fmt: skip
    assert all(e["pid"] == started[e["id"]] for e in recovered + finished)  # nobody was restarted
    assert sorted((e["gen"], e["committed"]) for e in recovered if e["id"] == 0) == [(1, 3), (2, 5)]
    # the survivors re-laid out in place: each kept its live replica (the state of the committed step), no file read
    assert all(e["sources"]["path"] == "live" and e["sources"]["kept"] > 0 for e in recovered), recovered
    # the state chosen was the one the generation before trained (its snapshots' headers name it)
    assert all(e["sources"]["generation"] == e["gen"] - 1 for e in recovered), recovered
    losses = m.rows("losses.jsonl")
    # generation 0 to step 3, 1 to step 5, 2 to the end: nothing committed was done twice or skipped
    assert [(r["step"], r["gen"]) for r in losses] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 2), (7, 2), (8, 2)]
    # threads and descriptors: after the second fault (and the group timeout, which ends a wait left in the dead
    # group), at most one more than right after the first (a helper may still be inside a wait of the dead group;
    # a leak per fault - the error boards' store threads left 2 per generation - goes past it)
    for who in (0, 1):
        first = next(e for e in recovered if e["id"] == who and e["gen"] == 1)
        end = next(e for e in finished if e["id"] == who)
        assert end["threads"] <= first["threads"] + 1 and end["fds"] <= first["fds"] + 1, (first, end)
    for gen, world, start in ((1, 3, 3), (2, 2, 5)):  # a fresh job from the state each generation went on from
        ref = Machines(tmp_path / f"ref{gen}", world, job=f"r{gen}{os.getpid()}")
        try:
            ref.start(["--steps", str(start + 2 if gen == 1 else 8), "--reference", str(m.out / f"resumed-g{gen}")])
            assert ref.wait(0) == [0], ref.text(0)[-3000:]
        finally:
            ref.close()
        expected = {r["step"]: r["loss"] for r in ref.rows("reference.jsonl")}
        got = {r["step"]: r["loss"] for r in losses if r["gen"] == gen}
        assert sorted(expected) == sorted(got) and got == expected  # to the bit (JSON keeps a float64 whole)


@pytest.mark.parametrize("machines", [3], indirect=True)
def test_a_stopped_machine_woken_after_the_recovery_is_fenced(machines: Machines) -> None:
    m = machines
    m.start(["--hold", "3", "--steps", "30"])
    m.wait_for("hold-*", 3)
    m.signal(2, signal.SIGSTOP)
    (m.out / "go").touch()
    m.wait_for("recovered-*", 2)  # both survivors are in generation 1 (and training)
    shm = sorted(p.name for p in (m.out / "shm2").rglob("*"))
    m.signal(2, signal.SIGCONT)
    assert m.wait(2) == [3], m.text(2)[-3000:]  # fenced: it leaves
    assert m.wait(0) == [0] and m.wait(1) == [0], m.text(0)[-3000:]
    assert sorted(p.name for p in (m.out / "shm2").rglob("*")) == shm  # nothing written on waking
    text = m.text(2)
    assert "fenced" in text and "generation 1" in text, text[-3000:]
    assert all(r["gen"] == 1 for r in m.rows("losses.jsonl") if r["step"] > 3)
    assert [e["id"] for e in m.rows("events.jsonl") if e["what"] == "finished"] in ([0, 1], [1, 0])


def test_a_machine_cut_off_before_its_copy_left_rolls_back_no_committed_step(tmp_path: Path) -> None:
    """Pipeline stages over 3 machines (machine 1 holds the only live copy of the middle stage): ``train_step(4)``
    returns on every worker, then machine 1 stops before its snapshot of step 4 leaves (the chaos run's partition
    at 180 s). Step 4 was never reported committed (``committed_step`` at most 3 on every row before the loss),
    the survivors go on from step 3 - the committed one - and train step 4 again: the step redone is one that
    ``train_step`` returned, no committed step is rolled back."""
    m = Machines(tmp_path / "job", 3, job=f"c{os.getpid()}")
    try:
        m.start(["--layout", "stages", "--steps", "6", "--cut", "1:4"])
        m.wait_for("recovered-*", 2)
        m.lose(1)  # (stopped: its copy of step 4 never left)
        assert m.wait(0) == [0] and m.wait(2) == [0], m.text(0)[-3000:] + m.text(2)[-3000:]
    finally:
        m.close()
    recovered = _events(m, "recovered")
    assert sorted((e["id"], e["gen"], e["failed_at"], e["committed"]) for e in recovered) == [
        (0, 1, 5, 3),
        (2, 1, 5, 3),
    ]
    for who in (0, 2):
        rows = m.rows(f"mine-{who}.jsonl")
        assert [(r["step"], r["gen"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 1), (6, 1)]
        assert all(r["committed"] in (r["step"] - 1, r["step"]) for r in rows[4:]), rows  # the survivors' own
        assert all(r["committed"] <= 3 for r in rows if r["gen"] == 0), rows  # step 4 returned, never committed


@pytest.mark.parametrize("machines", [3], indirect=True)
def test_stagewise_run_in_place_restarts_nobody_and_takes_a_machine_back(machines: Machines) -> None:
    """The user's command on every machine: torch's rendezvous numbers them, stagewise's agent starts the
    workers once; a lost machine restarts nobody; the same command started again on it while the job runs
    skips torch's rendezvous, its worker takes a fresh id and joins between steps; the launchers end with
    their workers (no exit barrier waiting for the lost machine)."""
    m = machines
    args = ["--hold", "3", "--hold-again", "5", "--steps", "9"]
    m.start_run(args, "2:3")
    m.wait_for("hold-*", 3)
    m.lose(2)
    (m.out / "go").touch()
    m.wait_for("again-*", 2)
    m.start_run(args, "2:3", only=[2])  # the machine back, its memory folder as the kill left it
    m.wait_text(2, "asks to join")
    (m.out / "go-again").touch()
    assert [m.wait(i, 240) for i in range(3)] == [[0]] * 3, m.text(0)[-3000:] + m.text(2)[-3000:]
    started = {e["id"]: e["pid"] for e in _events(m, "started")}
    recovered = _events(m, "recovered")
    assert sorted(started) == [0, 1, 2, 3], m.rows("events.jsonl")  # the newcomer: a fresh id, not 2
    assert sorted((e["id"], e["gen"], e["members"]) for e in recovered) == [
        (0, 1, [0, 1]), (0, 2, [0, 1, 3]), (1, 1, [0, 1]), (1, 2, [0, 1, 3]),
    ]  # fmt: skip
    assert all(e["pid"] == started[e["id"]] for e in recovered)
    gens = [(s, 0 if s <= 3 else 1 if s <= 7 else 2) for s in range(1, 10)]
    assert [(r["step"], r["gen"]) for r in m.rows("losses.jsonl")] == gens
    for i in (0, 1):
        assert "will restart worker group" not in m.text(i)
        # the loss in stagewise's words; gloo's text (a C++ file, an address) only in the file the line names
        failed = [line for line in m.text(i).splitlines() if "failed at step" in line]
        assert len(failed) == 1 and "failed at step 4: lost machine 2 (worker 2); " in failed[0], failed
        assert "gloo" not in failed[0] and "/__w/" not in failed[0], failed
        error = Path(failed[0].rsplit("(the error in full: ", 1)[1].removesuffix(")")).read_text()
        assert error.startswith("Traceback (most recent call last)") and "stopped or died" in error, error
    assert "the job runs already" in m.text(2)


@pytest.mark.parametrize(
    ("layout", "nproc"),
    [("stages", 1), ("pp2", 2)],
    ids=["only-copy-of-a-stage", "pp2-machine-of-two"],
)
def test_a_lost_stage_comes_back_from_its_neighbours_copy(layout: str, nproc: int, tmp_path: Path) -> None:
    """Pipelines of 3 machines, machine 1 lost between steps 3 and 4, its memory folder removed with it:

    * ``stages`` (1 process per machine, pp = the world, dp 1): machine 1 held the only live copy of the middle
      stage; the survivors cut the model into two stages, machine 1's stage from the copy on machine 2;
    * ``pp2`` (2 processes per machine, ``ElasticLayout(pp=2)``: pp 2 x dp 3 -> pp 2 x dp 2): machine 1 held
      two of the six stage copies (the other replicas hold those stages too: ``ElasticLayout`` keeps pp, so
      it never loses a stage's only copy).

    The survivors' losses equal, bit for bit, a fresh job of the new size resumed from the state the old
    layout saved at the committed step (not from the survivors' own state: a stage filled wrongly differs)."""
    m = Machines(tmp_path / "job", 3, nproc=nproc, job=f"s{layout}{os.getpid()}")
    try:
        m.start(["--layout", layout, "--hold", "3", "--steps", "6", "--save-held"])
        m.wait_for("hold-*", 3 * nproc)
        m.lose(1)
        assert m.wait(1) == [-signal.SIGKILL] * nproc
        shutil.rmtree(m.out / "shm1")  # its memory went with it: its part is only in machine 2's copy
        (m.out / "go").touch()
        assert m.wait(0) == [0] * nproc and m.wait(2) == [0] * nproc, m.text(0)[-3000:] + m.text(2)[-3000:]
    finally:
        m.close()
    started = {e["id"]: e["pid"] for e in _events(m, "started")}
    recovered = _events(m, "recovered")
    survivors = [r for i in (0, 2) for r in range(i * nproc, (i + 1) * nproc)]
    assert sorted((e["id"], e["gen"], e["members"], e["committed"]) for e in recovered) == [
        (r, 1, survivors, 3) for r in survivors
    ]
    assert all(e["pid"] == started[e["id"]] for e in recovered)
    # in place: live tensors where a survivor held them; machine 1's only copy of a stage from machine 2's file
    assert all(e["sources"]["path"] == "live" and e["sources"]["kept"] > 0 for e in recovered), recovered
    assert layout != "stages" or all(e["sources"]["snapshot"] > 0 for e in recovered), recovered
    alive = [(e["id"], e["old_alive"]) for e in recovered]
    assert all(n == 0 for _, n in alive), alive  # the failed pipeline's tensors went at once
    losses = m.rows("losses.jsonl")
    worlds = [(s, int(s > 3), nproc * (3 - (s > 3))) for s in range(1, 7)]
    assert [(r["step"], r["gen"], r["world"]) for r in losses] == worlds
    ref = Machines(tmp_path / "ref", 2, nproc=nproc, job=f"r{layout}{os.getpid()}")
    try:
        ref.start(["--layout", layout, "--steps", "6", "--reference", str(m.out / "held")])
        assert ref.wait(0) == [0] * nproc, ref.text(0)[-3000:]
    finally:
        ref.close()
    expected = {r["step"]: r["loss"] for r in ref.rows("reference.jsonl")}
    got = {r["step"]: r["loss"] for r in losses if r["gen"] == 1}
    assert sorted(expected) == [4, 5, 6] and got == expected  # to the bit (JSON keeps a float64 whole)


@pytest.mark.parametrize("machines", [3], indirect=True)
def test_a_lost_machine_started_again_with_nothing_joins_and_nobody_restarts(
    machines: Machines, tmp_path: Path
) -> None:
    """Machine 2 lost between steps 3 and 4 (generation 1: machines 0 and 1), its memory folder removed; started
    again while the others hold after step 5, it asks to join: the members take it in between steps, after the
    step they agree on (5 + MARGIN = 7, committed: no step lost or redone), and all three go on from that step's
    state - the newcomer's from the live members' snapshots, its own folder empty."""
    m = machines
    args = ["--hold", "3", "--hold-again", "5", "--steps", "10", "--save-resumed", "--settle", "12"]
    m.start(args)
    m.wait_for("hold-*", 3)
    m.lose(2)
    assert m.wait(2) == [-signal.SIGKILL]
    shutil.rmtree(m.out / "shm2")  # a spare with nothing: no snapshot of its own, nor of its neighbour's
    (m.out / "go").touch()
    m.wait_for("again-*", 2)  # generation 1 (machines 0 and 1) holds after step 5
    m.join(2, args)
    m.wait_text(2, "asks to join")
    (m.out / "go-again").touch()
    assert m.wait(0) == [0] and m.wait(1) == [0] and m.wait(2) == [0], m.text(0)[-3000:] + m.text(2)[-3000:]
    events = m.rows("events.jsonl")
    started = {e["id"]: e for e in events if e["what"] == "started"}
    recovered = _events(m, "recovered")
    finished = _events(m, "finished")
    assert sorted((e["id"], e["gen"], e["members"], e["committed"]) for e in recovered) == [
        (0, 1, [0, 1], 3), (0, 2, [0, 1, 3], 7), (1, 1, [0, 1], 3), (1, 2, [0, 1, 3], 7),
    ]  # fmt: skip
    # the newcomer: a fresh id (not 2, the lost machine's), generation 2, at the committed step
    assert (started[3]["gen"], started[3]["members"], started[3]["step"]) == (2, [0, 1, 3], 7)
    assert all(e["pid"] == started[e["id"]]["pid"] for e in recovered + finished)  # nobody was restarted
    assert sorted(e["id"] for e in finished) == [0, 1, 3]
    losses = m.rows("losses.jsonl")
    gens = [(s, 0 if s <= 3 else 1 if s <= 7 else 2, 3 if s <= 3 or s > 7 else 2) for s in range(1, 11)]
    assert [(r["step"], r["gen"], r["world"]) for r in losses] == gens
    mine = m.rows("mine-3.jsonl")  # the newcomer's own rows: the same losses as rank 0's
    assert [(r["step"], r["loss"]) for r in mine] == [(r["step"], r["loss"]) for r in losses if r["gen"] == 2]
    for who in (0, 1):  # threads and descriptors: two changes of membership leak nothing
        first = next(e for e in recovered if e["id"] == who and e["gen"] == 1)
        end = next(e for e in finished if e["id"] == who)
        assert end["threads"] <= first["threads"] + 1 and end["fds"] <= first["fds"] + 1, (first, end)
    for gen, world, last in ((1, 2, 7), (2, 3, 10)):  # a fresh job from the state each generation went on from
        ref = Machines(tmp_path / f"ref{gen}", world, job=f"j{gen}{os.getpid()}")
        try:
            ref.start(["--steps", str(last), "--reference", str(m.out / f"resumed-g{gen}")])
            assert ref.wait(0) == [0], ref.text(0)[-3000:]
        finally:
            ref.close()
        expected = {r["step"]: r["loss"] for r in ref.rows("reference.jsonl")}
        got = {r["step"]: r["loss"] for r in losses if r["gen"] == gen}
        assert sorted(expected) == sorted(got) and got == expected  # to the bit (JSON keeps a float64 whole)
