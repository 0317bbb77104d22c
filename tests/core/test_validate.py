"""The validator: it accepts the registered schedules and names what is wrong in broken ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stagewise as sw
from stagewise import Schedule, ScheduleError


def _from_text(text: str) -> Schedule:
    rows = [line.split(":", 1)[1].split() for line in text.strip().splitlines()]
    return Schedule.from_csv("\n".join(",".join(r) for r in rows) + "\n", name="hand")


def test_a_missing_backward_is_named() -> None:
    schedule = _from_text("rank 0: 0F0 0F1 0B0\n")
    with pytest.raises(ScheduleError, match=r"stage 0 micro-batch 1 has 0x 0B1"):
        sw.validate_schedule(schedule)


def test_a_gradient_sync_before_its_stages_last_backward_is_named() -> None:
    """(It was accepted, and the runtime reduced a tied weight's or a replica's gradient before the last
    micro-batch added its part: wrong gradients, no error.)"""
    early = _from_text(
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0SYNC\n"
        "rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1SYNC 1B1 1SEND_B1\n"
    )
    with pytest.raises(ScheduleError, match=r"#7 1B1 .*stage 1's B comes after its gradient sync \(#6 1SYNC\)"):
        sw.validate_schedule(early)
    with pytest.raises(ScheduleError, match=r"stage 0 has 2 gradient syncs \(0SYNC\), expected 1"):
        sw.validate_schedule(_from_text("rank 0: 0F0 0B0 0SYNC 0SYNC\n"))
    with pytest.raises(ScheduleError, match=r"stage 1 has 0 gradient syncs \(1SYNC\), expected 1"):
        sw.validate_schedule(_from_text("rank 0: 0F0 1F0 1B0 0B0 0SYNC\n"))
    sw.validate_schedule(_from_text("rank 0: 0F0 1F0 1B0 0I0 0W0 1SYNC 0SYNC\n"))  # after the W: fine
    with pytest.raises(ScheduleError, match=r"stage 0's W comes after its gradient sync"):
        sw.validate_schedule(_from_text("rank 0: 0F0 1F0 1B0 0I0 1SYNC 0SYNC 0W0\n"))


def test_an_asynchronous_schedule_read_back_from_its_csv_is_told_what_it_lacks() -> None:
    written = sw.build_schedule("pipedream", 2, 4).to_csv()
    with pytest.raises(ScheduleError, match=r"is invalid:\n  a stage steps more than once: an asynchronous .*"
                       r"weight-version table \(meta\['versions'\]\), which a CSV does not hold"):  # fmt: skip
        sw.validate_schedule(Schedule.from_csv(written))


def test_a_duplicated_forward_is_named() -> None:
    with pytest.raises(ScheduleError, match=r"2 forwards \(0F0\)"):
        sw.validate_schedule(_from_text("rank 0: 0F0 0F0 0B0\n"))


def test_backward_before_forward_and_w_before_i() -> None:
    with pytest.raises(ScheduleError, match="backward before its forward"):
        sw.validate_schedule(_from_text("rank 0: 0B0 0F0\n"))
    with pytest.raises(ScheduleError, match="W before its I"):
        sw.validate_schedule(_from_text("rank 0: 0F0 0W0 0I0\n"))


def test_an_action_on_the_wrong_rank_is_named() -> None:
    good = sw.build_schedule("gpipe", 2, 1)
    ranks = [list(r) for r in good.ranks]
    ranks[0].append(sw.Action(1, sw.ir.Kind.RECV_F, 0))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        sw.validate_schedule(good.with_ranks(ranks))


def test_local_data_order_across_two_stages_on_one_rank() -> None:
    # V placement: stages 0 and 1 both on rank 0; stage 1's forward cannot come first.
    schedule = _from_text("rank 0: 1F0 0F0 1B0 0B0")
    with pytest.raises(ScheduleError, match="needs stage 0's output for micro-batch 0"):
        sw.validate_schedule(schedule)


def test_compute_only_deadlock_is_found_and_explained() -> None:
    # Rank 1 wants the backward of micro-batch 1 first; rank 0 waits for 1B0 before sending F1.
    schedule = _from_text(
        """
        rank 0: 0F0 0B0 0F1 0B1
        rank 1: 1F1 1B1 1F0 1B0
        """
    )
    with pytest.raises(
        ScheduleError, match=r"deadlock: rank 1 action #0 1F1 .* waits for Message\(direction='F', stage=0"
    ):
        sw.validate_schedule(schedule)


def test_rendezvous_deadlock_when_sends_and_receives_are_not_batched() -> None:
    # 1F1B steady state with "send forward" and "receive backward" posted as separate blocking calls:
    # rank 0 sends F1 while rank 1 sends B0 — both wait for a receive the other has not posted.
    schedule = _from_text(
        """
        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B0 0B1 0RECV_B1
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
        """
    )
    with pytest.raises(ScheduleError) as err:
        sw.validate_schedule(schedule)
    # 0B0 before its receive is caught first; fix that and the hang remains.
    assert "uses Message(direction='B'" in str(err.value)
    # Batched, but with W between "send backward" and "receive forward" on rank 1: rank 0 blocks in
    # 0SEND_F1 (rank 1 has not posted 1RECV_F1) while rank 1 blocks in 1SEND_B0 (rank 0 posts
    # 0RECV_B0 only after 0F2). As pure data flow it would finish; with rendezvous it hangs.
    hang = _from_text(
        """
        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2
        rank 1: 1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2
        """
    )
    with pytest.raises(ScheduleError) as err:
        sw.validate_schedule(hang)
    message = str(err.value)
    assert "deadlock: rank 0 action #3 0SEND_F1" in message
    assert "deadlock: rank 1 action #3 1SEND_B0" in message
    assert "waits for the receive of Message(direction='B', stage=1, microbatch=0) on rank 0" in message
    sw.validate_schedule(hang.compute_only())  # the same order is fine as pure data flow


def test_the_same_exchange_batched_is_fine() -> None:
    ok = _from_text(
        """
        rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
        """
    )
    sw.validate_schedule(ok)


def test_channel_order_mismatch_is_named() -> None:
    bad = _from_text(
        """
        rank 0: 0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        rank 1: 1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1
        """
    )
    with pytest.raises(ScheduleError, match="channel rank 0 -> rank 1: message #0 is sent as .*stage=0, microbatch=0"):
        sw.validate_schedule(bad)


def test_missing_and_duplicate_communication() -> None:
    good = sw.build_schedule("gpipe", 2, 2)
    ranks = [list(r) for r in good.ranks]
    ranks[1] = [a for a in ranks[1] if str(a) != "1RECV_F1"]
    with pytest.raises(ScheduleError, match="received 0 times"):
        sw.validate_schedule(good.with_ranks(ranks))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["naive", "gpipe", "1f1b"]),
    p=st.integers(1, 6),
    m=st.integers(1, 12),
    split=st.booleans(),
)
def test_lowered_schedules_are_valid_and_complete(name: str, p: int, m: int, split: bool) -> None:
    schedule = sw.passes.lower(sw.schedules.generate(name, p, m), split=split)
    sw.validate_schedule(schedule)
    computes = [a for acts in schedule.ranks for a in acts if a.kind.is_compute]
    per_pair = 3 if split else 2
    assert len(computes) == per_pair * p * m
    sends = sum(a.kind in (sw.ir.Kind.SEND_F, sw.ir.Kind.SEND_B) for acts in schedule.ranks for a in acts)
    recvs = sum(a.kind in (sw.ir.Kind.RECV_F, sw.ir.Kind.RECV_B) for acts in schedule.ranks for a in acts)
    assert sends == recvs == 2 * (p - 1) * m


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), m=st.integers(1, 5), data=st.data())
def test_swapping_two_forwards_on_a_rank_breaks_something_or_stays_valid(p: int, m: int, data: st.DataObject) -> None:
    """Mutations of a valid schedule are either still valid or rejected with ScheduleError — never a crash."""
    schedule = sw.schedules.generate("1f1b", p, m)
    ranks = [list(r) for r in schedule.ranks]
    r = data.draw(st.integers(0, p - 1))
    i = data.draw(st.integers(0, len(ranks[r]) - 1))
    j = data.draw(st.integers(0, len(ranks[r]) - 1))
    ranks[r][i], ranks[r][j] = ranks[r][j], ranks[r][i]
    try:
        sw.validate_schedule(sw.passes.lower(schedule.with_ranks(ranks), validate=False))
    except ScheduleError:
        pass
