"""Our orders against torch's orders of the same schedules, stored as data (tests/golden/torch, made by its
generate.py): at every transfer time from 0 to one forward, ours is at least as fast in the simulator, within
the memory the schedules table promises.

The grid: p in {2, 4, 8}, m in {p, 2p, 4p} (DualPipeV needs m >= 2p), v = 2 for the two-stage-per-rank
schedules; transfer times 0, F/4, F/2, F; stage costs F = I = W (so B = 2F), and B = 2F split unevenly
(I = 1.5F, W = F/2).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.ir import Action, Kind, Schedule, loop_placement, v_placement
from stagewise.simulation import CostModel, simulate

TORCH = Path(__file__).parents[1] / "golden" / "torch"
INDEX: dict[str, dict[str, object]] = json.loads((TORCH / "index.json").read_text())
TRANSFERS = (0.0, 0.25, 0.5, 1.0)
COSTS = {"F = I = W": (1.0, 1.0), "I = 1.5F, W = F/2": (1.5, 0.5)}  # (I, W) with F = 1

#: registered synchronous schedules torch has no order for
NO_TORCH_ORDER = {"naive", "zb-h2"}

#: the schedules table's peak activations (micro-batches, F until I or B) for the grid's sizes (p divides m)
DOCUMENTED_PEAK = {
    "gpipe": lambda p, m: m,
    "1f1b": lambda p, m: min(p, m),
    "interleaved-1f1b": lambda p, m: min(p, m) if m <= p else p + (p - 1) / 2,  # v = 2: p + (p-1)/v
    "looped-bfs": lambda p, m: m,
    "zb-h1": lambda p, m: min(p, m),
    "zb-v": lambda p, m: min(p, m),
    "dualpipe-v": lambda p, m: p + 0.5 if m >= 2 * p else min(p, m),
}


def cases() -> list[tuple[str, int, int, int]]:
    """(torch class, p, m, v) of every stored order."""
    found = []
    for path in sorted(TORCH.glob("*.csv")):
        name, p, m, v = path.stem.rsplit("-", 3)
        found.append((name, int(p[1:]), int(m[1:]), int(v[1:])))
    return found


@cache
def torch_order(name: str, p: int, m: int, v: int) -> Schedule:
    entry = INDEX[name]
    placement = loop_placement(p, v) if entry["placement"] == "loop" else v_placement(p, v)
    path = TORCH / f"{name}-p{p}-m{m}-v{v}.csv"
    return sw.from_torch(path, name=f"torch {name}", placement=placement, num_microbatches=m)


def makespans(schedule: Schedule, input_grad: float, weight_grad: float) -> list[float]:
    n = schedule.num_stages
    return [
        simulate(
            schedule, CostModel.uniform(n, backward_input=input_grad, backward_weight=weight_grad, comm_time=c)
        ).makespan
        for c in TRANSFERS
    ]


def test_the_stored_orders_cover_every_registered_synchronous_schedule() -> None:
    compared = {str(entry["schedule"]) for entry in INDEX.values()}
    assert compared | NO_TORCH_ORDER == set(sw.schedule_names(synchronous=True))
    assert not compared & NO_TORCH_ORDER
    stored = {(name, p, m) for name, p, m, _ in cases()}
    for name in INDEX:
        expected = {(name, p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) if name != "DualPipeV" or m >= 2 * p}
        assert {c for c in stored if c[0] == name} == expected, name


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}")
def test_torch_orders_lower_and_validate(case: tuple[str, int, int, int]) -> None:
    """Paper-style warm-ups (different depths on neighbouring ranks) need no special care: they lower and
    validate, deadlock-free, like ours."""
    sw.validate_schedule(sw.passes.lower(torch_order(*case)))


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}")
def test_ours_is_at_least_as_fast_as_torchs_within_our_documented_peak(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    schedule = str(INDEX[name]["schedule"])
    theirs, ours = torch_order(name, p, m, v), sw.schedules.generate(schedule, p, m, v)
    peak = DOCUMENTED_PEAK[schedule](p, m)
    assert max(simulate(ours).peak_activations) <= peak, (schedule, p, m)
    assert max(simulate(theirs).peak_activations) <= peak, f"torch's {name} at p={p}, m={m} holds more than {peak}"
    for costs, (input_grad, weight_grad) in COSTS.items():
        mine, torchs = makespans(ours, input_grad, weight_grad), makespans(theirs, input_grad, weight_grad)
        slower = [(c, a, b) for c, a, b in zip(TRANSFERS, mine, torchs, strict=True) if a > b]
        assert not slower, f"{schedule} p={p} m={m} ({costs}): (transfer, ours, torch's) {slower}"


def test_where_the_orders_are_the_same() -> None:
    """GPipe, 1F1B (as its step() runs it) and ZB-H1 are torch's orders exactly (compute actions: torch's
    REDUCE_GRAD is read as SYNC), ZB-V (the paper's) and interleaved 1F1B (Megatron-LM's) are torch's orders
    whenever m > p, and DualPipeV's is ours
    with each full backward B written as I then W. (Torch's looped BFS runs each stage's backwards last
    micro-batch first.)"""
    same = {"GPipe", "1F1B", "InterleavedZeroBubble"}
    for name, p, m, v in cases():
        ours = sw.schedules.generate(str(INDEX[name]["schedule"]), p, m, v)
        theirs = tuple(tuple(a for a in acts if a.kind is not Kind.SYNC) for acts in torch_order(name, p, m, v).ranks)
        if name in same or (name in ("ZBVZeroBubble", "Interleaved1F1B") and m > p):
            assert ours.ranks == theirs, (name, p, m)
        if name == "DualPipeV":
            split = [[b for a in acts for b in split_b(a)] for acts in theirs]
            assert ours.ranks == tuple(map(tuple, split)), (name, p, m)


def split_b(action: Action) -> list[Action]:
    if action.kind is not Kind.B:
        return [action]
    return [Action(action.stage, Kind.I, action.microbatch), Action(action.stage, Kind.W, action.microbatch)]
