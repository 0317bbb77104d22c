"""The validator's rules, stated once: each check written the obvious way, on Action objects.

:data:`RULES` lists them in the order they are checked (the package's door, :mod:`stagewise.validate`, says
what each one asks). Each check writes every problem it finds with its rank, action and neighbours; the first
rule that fails is the one reported. The fast paths (:mod:`.fast`, :mod:`.arrays`) decide the same rules on
flat integers and only say "valid or not"; property tests on schedules that break each rule keep them in
agreement with these checks (tests/core/test_validator_rules.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable

from ..ir import Action, Kind, Message, Schedule, consumes, message_of, produces


def is_forward_only(schedule: Schedule) -> bool:
    """True for an eval schedule made by :func:`stagewise.passes.lowering.forward_only` (no backward work expected)."""
    return bool(schedule.meta.get("forward_only", False))


def reference_problems(schedule: Schedule) -> list[str]:
    """Every problem of the first rule that fails (empty when the schedule is valid)."""
    broken = broken_rule(schedule)
    return [] if broken is None else broken[1]


def broken_rule(schedule: Schedule) -> tuple[str, list[str]] | None:
    """The first rule of :data:`RULES` that ``schedule`` breaks, by name, with every problem of it; None if
    valid."""
    for name, check in RULES:
        problems = check(schedule)
        if problems:
            return name, problems
    return None


def _where(schedule: Schedule, rank: int, idx: int) -> str:
    acts = schedule.ranks[rank]
    lo, hi = max(0, idx - 2), min(len(acts), idx + 3)
    around = " ".join(f"[{a}]" if j == idx else str(a) for j, a in enumerate(acts[lo:hi], lo))
    return f"rank {rank} action #{idx} {acts[idx]} (in: ... {around} ...)"


def _check_placement(schedule: Schedule) -> list[str]:
    problems = []
    n, m = schedule.num_stages, schedule.num_microbatches
    for rank, acts in enumerate(schedule.ranks):
        for idx, a in enumerate(acts):
            if not 0 <= a.stage < n:
                problems.append(f"{_where(schedule, rank, idx)}: stage {a.stage} is outside 0..{n - 1}")
            elif a.microbatch is not None and not 0 <= a.microbatch < m:
                problems.append(f"{_where(schedule, rank, idx)}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            elif schedule.placement[a.stage] != rank:
                problems.append(
                    f"{_where(schedule, rank, idx)}: stage {a.stage} lives on rank {schedule.placement[a.stage]}"
                )
    return problems


def _check_completeness(schedule: Schedule) -> list[str]:
    counts: Counter[tuple[int, Kind, int | None]] = Counter(
        (a.stage, a.kind, a.microbatch) for acts in schedule.ranks for a in acts if a.kind.is_compute
    )
    problems = []
    forward_only = is_forward_only(schedule)
    for s in range(schedule.num_stages):
        rank = schedule.placement[s]
        for i in range(schedule.num_microbatches):
            f, b, ii, w = (counts[(s, k, i)] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
            if f != 1:
                problems.append(f"rank {rank}: stage {s} micro-batch {i} has {f} forwards ({s}F{i}), expected 1")
            if forward_only:
                if (b, ii, w) != (0, 0, 0):
                    problems.append(
                        f"rank {rank}: stage {s} micro-batch {i} has {b}x {s}B{i}, {ii}x {s}I{i}, {w}x {s}W{i} "
                        "in a forward-only schedule, expected no backward work"
                    )
            elif (b, ii, w) not in ((1, 0, 0), (0, 1, 1)):
                problems.append(
                    f"rank {rank}: stage {s} micro-batch {i} has {b}x {s}B{i}, {ii}x {s}I{i}, {w}x {s}W{i}; "
                    "expected one B, or one I and one W"
                )
    return problems


def _check_local_order(schedule: Schedule) -> list[str]:
    problems = []
    n = schedule.num_stages
    for rank, acts in enumerate(schedule.ranks):
        done: set[tuple[int, Kind, int | None]] = set()
        for idx, a in enumerate(acts):
            key = (a.stage, a.kind, a.microbatch)
            if a.kind in (Kind.B, Kind.I) and (a.stage, Kind.F, a.microbatch) not in done:
                problems.append(f"{_where(schedule, rank, idx)}: backward before its forward {a.stage}F{a.microbatch}")
            if a.kind is Kind.W and (a.stage, Kind.I, a.microbatch) not in done:
                problems.append(f"{_where(schedule, rank, idx)}: W before its I {a.stage}I{a.microbatch}")
            if a.kind.is_compute:
                need = consumes(a, n)
                if need is not None and schedule.placement[need.stage] == rank:
                    kinds = (Kind.F,) if need.direction == "F" else (Kind.B, Kind.I)
                    if not any((need.stage, k, need.microbatch) in done for k in kinds):
                        problems.append(
                            f"{_where(schedule, rank, idx)}: needs stage {need.stage}'s "
                            f"{'output' if need.direction == 'F' else 'input gradient'} for micro-batch "
                            f"{need.microbatch}, which this rank computes later"
                        )
            done.add(key)
    return problems


def _check_steps(schedule: Schedule) -> list[str]:
    """Optimizer steps: one per stage if any, after all the stage's compute and its SYNC (itself checked by
    :func:`_check_syncs`). A forward-only schedule has neither SYNC nor STEP: it computes no gradients."""
    problems = []
    if is_forward_only(schedule):
        for rank, acts in enumerate(schedule.ranks):
            for idx, a in enumerate(acts):
                if a.kind in (Kind.SYNC, Kind.STEP):
                    problems.append(f"{_where(schedule, rank, idx)}: a forward-only schedule has no {a.kind.value}")
        return problems
    if schedule.is_asynchronous:  # a SYNC and a STEP per mini-batch: stagewise.validate.versions checks them
        return problems
    steps: Counter[int] = Counter(a.stage for acts in schedule.ranks for a in acts if a.kind is Kind.STEP)
    if steps and max(steps.values()) > 1:  # as an asynchronous schedule read back from its CSV: say so first
        problems.append(
            "a stage steps more than once: an asynchronous schedule's STEP per mini-batch needs its weight-version "
            "table (meta['versions']), which a CSV does not hold - build one by name, e.g. "
            "sw.build_schedule('pipedream', p, m)"
        )
    problems += _check_syncs(schedule)
    if not steps:
        return problems
    for s in range(schedule.num_stages):
        if steps[s] != 1:
            problems.append(
                f"rank {schedule.placement[s]}: stage {s} has {steps[s]} optimizer steps ({s}STEP), expected 1 "
                "(a schedule with STEP actions steps every stage exactly once)"
            )
    for rank, acts in enumerate(schedule.ranks):
        stepped: dict[int, int] = {}  # stage -> index of its STEP
        for idx, a in enumerate(acts):
            if a.kind is Kind.STEP:
                stepped.setdefault(a.stage, idx)
            elif a.stage in stepped and (a.kind.is_compute or a.kind is Kind.SYNC):
                problems.append(
                    f"{_where(schedule, rank, idx)}: stage {a.stage}'s {a.kind.value} comes after its optimizer "
                    f"step (#{stepped[a.stage]} {a.stage}STEP); STEP must follow all the stage's compute and its SYNC"
                )
    return problems


def _check_syncs(schedule: Schedule) -> list[str]:
    """A SYNC marks a stage's gradients final (a replica's all-reduce and a tie's sum start there): a schedule
    with SYNC actions syncs each stage once, after all of the stage's B and W. One before a B or W of its stage
    would reduce gradients the later micro-batches still add to (a schedule without any SYNC gets them from the
    lowering, after each stage's last B or W)."""
    syncs: Counter[int] = Counter(a.stage for acts in schedule.ranks for a in acts if a.kind is Kind.SYNC)
    problems = [
        f"rank {schedule.placement[s]}: stage {s} has {syncs[s]} gradient syncs ({s}SYNC), expected 1 (a schedule "
        "with SYNC actions syncs every stage once, after its last backward)"
        for s in range(schedule.num_stages)
        if syncs and syncs[s] != 1
    ]
    for rank, acts in enumerate(schedule.ranks):
        synced: dict[int, int] = {}  # stage -> index of its first SYNC
        for idx, a in enumerate(acts):
            if a.kind is Kind.SYNC:
                synced.setdefault(a.stage, idx)
            elif a.stage in synced and a.kind in (Kind.B, Kind.W):
                problems.append(
                    f"{_where(schedule, rank, idx)}: stage {a.stage}'s {a.kind.value} comes after its gradient sync "
                    f"(#{synced[a.stage]} {a.stage}SYNC); a SYNC marks the stage's gradients final, so it must "
                    f"follow every {a.stage}B and {a.stage}W"
                )
    return problems


def _check_communication(schedule: Schedule) -> list[str]:
    """Every cross-rank message: one send after it is made, one receive before it is used; then channel order.
    A compute-only schedule has no communication of its own: nothing to check."""
    if not schedule.is_complete:
        return []
    needed = _crossing(schedule)
    return _check_sends_and_receives(schedule, needed) or _check_channel_order(schedule, needed)


def _crossing(schedule: Schedule) -> dict[Message, tuple[int, int]]:
    """Every value the compute actions make that another rank uses: message -> (src rank, dst rank)."""
    n, placement = schedule.num_stages, schedule.placement
    needed: dict[Message, tuple[int, int]] = {}
    for acts in schedule.ranks:
        for a in acts:
            msg = produces(a, n) if a.kind.is_compute else None
            if msg is None:
                continue
            dst_stage = msg.stage + 1 if msg.direction == "F" else msg.stage - 1
            src, dst = placement[msg.stage], placement[dst_stage]
            if src != dst:
                needed[msg] = (src, dst)
    return needed


def _check_sends_and_receives(schedule: Schedule, needed: dict[Message, tuple[int, int]]) -> list[str]:
    """Each crossing value sent once, after it is made, and received once, before it is used; nothing else sent
    or received."""
    n = schedule.num_stages
    problems = []
    sends: dict[Message, list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[Message, list[tuple[int, int]]] = defaultdict(list)
    for rank, acts in enumerate(schedule.ranks):
        made: set[Message] = set()
        got: set[Message] = set()
        for idx, a in enumerate(acts):
            if a.kind.is_compute:
                out = produces(a, n)
                if out is not None:
                    made.add(out)
                need = consumes(a, n)
                if need is not None and need in needed and need not in got:
                    problems.append(f"{_where(schedule, rank, idx)}: uses {need} before receiving it")
            elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                msg = message_of(a)
                sends[msg].append((rank, idx))
                if msg not in needed:
                    problems.append(
                        f"{_where(schedule, rank, idx)}: sends a value that stays on its rank or is never made"
                    )
                elif msg not in made:
                    problems.append(f"{_where(schedule, rank, idx)}: sends {msg} before computing it")
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                msg = message_of(a)
                recvs[msg].append((rank, idx))
                got.add(msg)
                if msg not in needed:
                    problems.append(f"{_where(schedule, rank, idx)}: receives a value no other rank sends")
    for msg, (src, dst) in needed.items():
        if len(sends[msg]) != 1:
            problems.append(
                f"rank {src}: {msg} (stage {msg.stage} -> rank {dst}) is sent {len(sends[msg])} times, expected 1"
            )
        if len(recvs[msg]) != 1:
            problems.append(f"rank {dst}: {msg} (from rank {src}) is received {len(recvs[msg])} times, expected 1")
    return problems


def _check_channel_order(schedule: Schedule, needed: dict[Message, tuple[int, int]]) -> list[str]:
    """Channel order: the k-th send from a to b must meet the k-th receive on b from a (point-to-point matches
    in posting order). Run once every op is known to be needed, so ``needed`` names both ends."""
    problems = []
    send_order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    recv_order: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank, acts in enumerate(schedule.ranks):
        for a in acts:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                msg = message_of(a)
                send_order[(rank, needed[msg][1])].append(msg)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                msg = message_of(a)
                recv_order[(needed[msg][0], rank)].append(msg)
    for (src, dst), sent in send_order.items():
        got_list = recv_order[(src, dst)]
        for k, (s_msg, r_msg) in enumerate(zip(sent, got_list)):
            if s_msg != r_msg:
                problems.append(
                    f"channel rank {src} -> rank {dst}: message #{k} is sent as {s_msg} but received as {r_msg}; "
                    "point-to-point matches in posting order, so both ranks must agree"
                )
                break
    return problems


def _check_progress(schedule: Schedule) -> list[str]:
    """The ranks run together can finish: the blocking, batched rendezvous for a complete schedule, data flow
    for a compute-only one."""
    return _check_rendezvous(schedule) if schedule.is_complete else dataflow_problems(schedule)


def _segments(acts: tuple[Action, ...]) -> list[tuple[int, int]]:
    """[start, end) of each compute action or maximal run of non-compute actions."""
    segs, idx = [], 0
    while idx < len(acts):
        end = idx + 1
        if not acts[idx].kind.is_compute:
            while end < len(acts) and not acts[end].kind.is_compute:
                end += 1
        segs.append((idx, end))
        idx = end
    return segs


def _check_rendezvous(schedule: Schedule) -> list[str]:
    """Run all ranks with blocking batched point-to-point; report where they would hang."""
    ranks = schedule.ranks
    segs = [_segments(acts) for acts in ranks]
    pos = [0] * len(ranks)
    in_batch = [False] * len(ranks)  # has the rank posted its current batch?
    missing = [0] * len(ranks)  # partners its current batch still waits for
    posted: set[tuple[str, Message]] = set()
    waiting: dict[tuple[str, Message], int] = {}  # the partner op a rank waits for -> that rank
    queue = deque(range(len(ranks)))
    while queue:
        rank = queue.popleft()
        while pos[rank] < len(segs[rank]):
            if in_batch[rank]:
                if missing[rank]:
                    break
                in_batch[rank] = False
                pos[rank] += 1
                continue
            start, end = segs[rank][pos[rank]]
            comm = [a for a in ranks[rank][start:end] if a.kind.is_comm]
            if not comm:
                pos[rank] += 1
                continue
            in_batch[rank] = True
            for a in comm:
                side = "S" if a.kind in (Kind.SEND_F, Kind.SEND_B) else "R"
                other = "R" if side == "S" else "S"
                msg = message_of(a)
                posted.add((side, msg))
                if (other, msg) in posted:
                    partner = waiting.pop((side, msg), None)
                    if partner is not None:
                        missing[partner] -= 1
                        if missing[partner] == 0:
                            queue.append(partner)
                else:
                    waiting[(other, msg)] = rank
                    missing[rank] += 1
    problems = []
    for rank in range(len(ranks)):
        if pos[rank] < len(segs[rank]):
            start, end = segs[rank][pos[rank]]
            idx = next(j for j in range(start, end) if ranks[rank][j].kind.is_comm)
            waits = [
                f"{'send' if side == 'S' else 'receive'} of {msg} on rank {_peer(schedule, msg, side)}"
                for (side, msg), r in waiting.items()
                if r == rank
            ]
            problems.append(f"deadlock: {_where(schedule, rank, idx)} waits for the {', '.join(waits)}")
    return problems


def _peer(schedule: Schedule, msg: Message, side: str) -> int:
    dst = msg.stage + 1 if msg.direction == "F" else msg.stage - 1
    return schedule.placement[msg.stage] if side == "S" else schedule.placement[dst]


def dataflow_problems(schedule: Schedule) -> list[str]:
    """Compute-only schedules: can every rank finish if each action waits for its inputs?"""
    n = schedule.num_stages
    ranks = schedule.ranks
    pos = [0] * len(ranks)
    done: set[Message] = set()
    waiting: dict[Message, int] = {}
    queue = deque(range(len(ranks)))
    while queue:
        rank = queue.popleft()
        acts = ranks[rank]
        while pos[rank] < len(acts):
            a = acts[pos[rank]]
            need = consumes(a, n) if a.kind.is_compute else None
            if need is not None and need not in done:
                waiting[need] = rank
                break
            made = produces(a, n) if a.kind.is_compute else None
            if made is not None:
                done.add(made)
                waiter = waiting.pop(made, None)
                if waiter is not None:
                    queue.append(waiter)
            pos[rank] += 1
    problems = []
    for rank, acts in enumerate(ranks):
        if pos[rank] < len(acts):
            a = acts[pos[rank]]
            need = consumes(a, n)
            assert need is not None
            src = schedule.placement[need.stage]
            blocker = ranks[src][pos[src]] if pos[src] < len(ranks[src]) else None
            problems.append(
                f"deadlock: {_where(schedule, rank, pos[rank])} waits for {need} from rank {src}, "
                f"which is itself stuck at {blocker}"
            )
    return problems


#: The rules, by name, in the order they are checked, each with the check that names its problems.
RULES: tuple[tuple[str, Callable[[Schedule], list[str]]], ...] = (
    ("placement", _check_placement),
    ("completeness", _check_completeness),
    ("local order", _check_local_order),
    ("optimizer steps", _check_steps),
    ("communication", _check_communication),
    ("progress", _check_progress),
)
