"""The membership's count of a silent member (runtime/elastic/membership.py), on a fake store and a fake clock:
events, never wall time. A member cut off a threshold before the agreement is counted gone without a second
wait; a member whose clock is off, or whose stamps were held behind a store call, is never counted by its stamp's
age alone."""

from __future__ import annotations

from datetime import timedelta

from stagewise.runtime.elastic import membership as ms


class Store:
    """A c10d store's calls the membership uses, in a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        if self.kv.get(key, b"").decode() == expected:
            self.kv[key] = value.encode()
        return self.kv[key]

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if not self.check(keys):
            raise TimeoutError(keys)


class Clock:
    """This worker's clock and the wall clock, moved by the test (and by the agreement's sleeps); ``each`` runs
    at every tick (what the other members do meanwhile)."""

    def __init__(self) -> None:
        self.t, self.skew, self.each = 0.0, 1000.0, [lambda: None]

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.t + self.skew

    def sleep(self, s: float) -> None:
        self.t += s
        self.each[0]()


def _member(store: Store, clock: Clock, silent_s: float = 10.0) -> ms.Membership:
    m = ms.Membership(store, 0, [0, 1, 2], silent_s=silent_s, clock=clock.now, wall=clock.wall, sleep=clock.sleep)
    m.start()  # (its thread's first tick is STAMP_S away: the test looks itself)
    m.stop()
    return m


def _train(store: Store, clock: Clock, m: ms.Membership, seconds: float, stamping: dict[int, float]) -> None:
    """``seconds`` of training: every STAMP_S the members in ``stamping`` stamp (their clock's offset), and
    member 0's thread looks."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t += ms.STAMP_S
        for who, offset in stamping.items():
            store.set(f"alive/{who}", repr(clock.wall() + offset))
        m.look()


def test_a_member_cut_off_a_threshold_ago_is_counted_at_once_by_what_was_seen_before() -> None:
    """A partition whose failure named nobody: member 2 stopped stamping when its link went down, 10.5 s before
    the agreement. The stamping thread watched it stand still all along, so the agreement needs no second wait
    (it used to confirm for 1.25 s from its own start: the partition's worst trials)."""
    store, clock = Store(), Clock()
    m = _member(store, clock)
    _train(store, clock, m, 5.0, {1: 0.0, 2: 0.0})
    _train(store, clock, m, 10.5, {1: 0.0})  # link down: 2 is silent, 1 trains on
    store.set("gen1/arrived/1", "1")  # the other survivor asked first (and waits at the barrier)
    store.set("gen1/ready/1", "1")
    began = clock.t
    assert m.next(10.0) == [0, 1]
    assert clock.t - began < ms._CONFIRM_S / 2, clock.t - began  # decided at once, not after the confirmation
    assert m.decided[2].startswith("silent 10."), m.decided


def test_without_watching_before_the_agreement_the_confirmation_is_waited() -> None:
    """The same silence, but this worker's looks stopped 3 s before the agreement (its store client was held):
    nothing seen across the gap counts, so the stamp must stand still for the confirmation first."""
    store, clock = Store(), Clock()
    m = _member(store, clock)
    _train(store, clock, m, 5.0, {1: 0.0, 2: 0.0})
    _train(store, clock, m, 7.5, {1: 0.0})
    clock.t += 3.0  # no look for 3 s (held), then the agreement
    store.set("gen1/arrived/1", "1")
    store.set("gen1/ready/1", "1")
    m.look()  # the first look after the gap watches afresh
    began = clock.t
    assert m.next(10.0) == [0, 1]
    assert clock.t - began >= ms._CONFIRM_S - 1e-9, clock.t - began
    assert m.decided[2].startswith("silent 1"), m.decided  # by its stamp's age (10.5 s + the confirmation)


def test_a_live_member_whose_clock_is_behind_is_never_counted_by_its_stamps_age() -> None:
    """Member 2's clock is 60 s behind: its stamps look 60 s old, but they move, so it is not silent; it is
    slow to notice the failure (asks 3 s after the others) and is kept."""
    store, clock = Store(), Clock()
    m = _member(store, clock)
    _train(store, clock, m, 8.0, {1: 0.0, 2: -60.0})
    store.set("gen1/arrived/1", "1")
    store.set("gen1/ready/1", "1")
    began = clock.t

    def member_2() -> None:
        store.set("alive/2", repr(clock.wall() - 60.0))  # it stamps on (a tick per poll: more often, alike)
        if clock.t - began >= 3.0:
            store.set("gen1/arrived/2", "1")
            store.set("gen1/ready/2", "1")

    clock.each[0] = member_2
    assert m.next(10.0) == [0, 1, 2]
    assert m.decided[2].startswith("asked at 3."), m.decided


def test_a_member_held_for_less_than_the_confirmation_with_its_clock_behind_is_kept() -> None:
    """Member 2's clock is 60 s behind and its stamps stop for 1 s (a store call held its client) just as the
    agreement begins: its stamp's age is past the threshold, but it did not stand still for the confirmation."""
    store, clock = Store(), Clock()
    m = _member(store, clock)
    _train(store, clock, m, 8.0, {1: 0.0, 2: -60.0})
    _train(store, clock, m, 0.5, {1: 0.0})  # 2's last stamp, then held
    store.set("gen1/arrived/1", "1")
    store.set("gen1/ready/1", "1")
    began = clock.t

    def member_2() -> None:
        if clock.t - began >= 0.7:
            store.set("alive/2", repr(clock.wall() - 60.0))
            store.set("gen1/arrived/2", "1")
            store.set("gen1/ready/2", "1")

    clock.each[0] = member_2
    assert m.next(10.0) == [0, 1, 2]
    assert m.decided[2].startswith("asked at"), m.decided


class Counted(Store):
    """The fake store with ``multi_get``, counting the round trips."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def get(self, key: str) -> bytes:
        self.calls += 1
        return super().get(key)

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return super().check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls += 1
        return [self.kv[k] for k in keys]


def test_a_look_reads_every_stamp_in_two_round_trips_whatever_the_size() -> None:
    store = Counted()
    for who in range(12):
        store.set(f"alive/{who}", repr(100.0 + who))
    m = ms.Membership(store, 0, list(range(12)))
    store.calls = 0
    m.look()
    assert store.calls == 2
    assert {w: s for w, (s, _) in m._seen.items()} == {w: repr(100.0 + w).encode() for w in range(1, 12)}


def test_a_member_not_stamped_yet_is_read_as_none_one_by_one() -> None:
    store = Counted()
    store.set("alive/1", "5.0")
    assert ms.stamps_of(store, [1, 2]) == {1: b"5.0", 2: None}
    assert ms.stamps_of(Store(), []) == {}


def test_a_live_member_s_longest_stand_still_is_the_margin_read() -> None:
    """Member 1 stamps every STAMP_S, then its stamping thread is held 2 s (a loaded machine) and it stamps
    again: the longest stand-still read before its stamp moved, below the 3 s silence, is kept (what the
    silence check read of it, 2 s less a look's half-period at most, never the moved stamp's full gap). Member 2
    stands still 4 s, past the silence, then stamps again: counted as one that came back, not as margin."""
    store, clock = Store(), Clock()
    m = _member(store, clock, silent_s=3.0)
    _train(store, clock, m, 3.0, {1: 0.0, 2: 0.0})
    assert m.margin.live_s <= ms.STAMP_S and m.margin.came_back == 0  # every look read a fresh stamp
    _train(store, clock, m, 2.0, {2: 0.0})  # 1 held for 2 s
    _train(store, clock, m, 1.0, {1: 0.0, 2: 0.0})
    assert 2.0 - ms.STAMP_S <= m.margin.live_s <= 2.0, m.margin.live_s
    _train(store, clock, m, 4.5, {1: 0.0})  # 2 silent for 4.5 s
    _train(store, clock, m, 1.0, {1: 0.0, 2: 0.0})
    assert m.margin.came_back == 1 and m.margin.live_s <= 2.0, m.margin
