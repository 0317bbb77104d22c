"""A snapshot copy in one round (issue 48 item 4, the snapshot's cost): the lengths of the last exchange agreed.

On a rank with no spare core the threads that post a copy's messages run in the core's idle time, and every
message that waits for the one before costs a round of both ranks' idle moments. A snapshot's head keeps its
padded length and its payload its length from one step to the next, so from the second exchange with a peer on
the receiver posts the preamble and every part at once, and the sender posts everything at once; a length that
changed is sent after one byte into each posted part, and two sides out of step are refused. The fake wire
matches messages as gloo does (in order, a message into the start of its receive, a longer one failing)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.fake_wire import Loop, Rank
from runtime.test_snapshot_giveup import _payload
from stagewise.runtime.comm import snapshot_exchange
from stagewise.runtime.comm.snapshot_exchange import AFTER, AS_POSTED, FILLED, Agreed
from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic import idle, mapped, snapshot_copies
from stagewise.runtime.elastic.peers import Peers
from stagewise.runtime.elastic.snapshot_file import tensors_of, verified
from stagewise.runtime.errors import PipelineError


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch) -> Loop:
    wire = Loop()
    monkeypatch.setattr(snapshot_exchange.dist, "isend", wire.isend)
    monkeypatch.setattr(snapshot_exchange.dist, "irecv", wire.irecv)
    return wire


def _bytes(n: int, seed: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 7 + seed).remainder(251).to(torch.uint8)


def _both(loop: Loop, parts: dict[int, list[torch.Tensor]], agreed: dict[int, Agreed], timeout: float = 60.0) -> Any:
    """Ranks 0 and 1 each send ``parts[rank]`` to the other and receive the other's, at once; their Settled."""
    loop.events.clear()
    out: dict[int, Any] = {}

    def run(me: int) -> None:
        other = 1 - me
        out[me] = snapshot_exchange.exchange_parts(parts[me], other, [other], Rank(me), timeout, agreed=agreed[me])

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _recv_events(loop: Loop, rank: int) -> list[str]:
    return [kind for kind, _, _ in loop.events[rank] if kind.endswith("recv")]


def _send_events(loop: Loop, rank: int) -> list[str]:
    return [kind for kind, _, _ in loop.events[rank] if kind.endswith("send")]


def _whole(done: Any, peer: int, parts: list[torch.Tensor]) -> bool:
    return done.failed == [] and all(torch.equal(g, p) for g, p in zip(done.parts[peer], parts, strict=True))


def test_from_the_second_exchange_on_every_part_is_posted_with_the_preamble(loop: Loop) -> None:
    """The first exchange with a peer: the receiver posts the parts once the preamble is in (two rounds); from the
    second on, before it (one round). The sender posts everything at once both times; the bytes come whole."""
    agreed = {0: Agreed(), 1: Agreed()}
    for k in range(3):
        parts = {r: [_bytes(8, 10 * k + r), _bytes(16, 10 * k + r + 5)] for r in (0, 1)}
        done = _both(loop, parts, agreed)
        for r in (0, 1):
            assert _whole(done[r], 1 - r, parts[1 - r])
            assert _send_events(loop, r) == ["post send"] * 3 + ["wait send"] * 3  # (all at once)
            if k == 0:
                assert _recv_events(loop, r) == ["post recv", "wait recv"] + ["post recv"] * 2 + ["wait recv"] * 2
            else:
                assert _recv_events(loop, r) == ["post recv"] * 3 + ["wait recv"] * 3
            assert agreed[r].sent == {1 - r: [8, 16]} and agreed[r].expected == {1 - r: [8, 16]}


def test_a_length_that_changed_fills_the_posted_parts_and_follows_them(loop: Loop) -> None:
    """Rank 0's payload grows (a re-layout): rank 1's posted parts get one byte each, the real ones follow and
    are received whole; the lengths agreed move, and the next exchange is one round again."""
    agreed = {0: Agreed(), 1: Agreed()}
    _both(loop, {r: [_bytes(8, r), _bytes(16, r)] for r in (0, 1)}, agreed)
    parts = {0: [_bytes(8, 3), _bytes(24, 4)], 1: [_bytes(8, 5), _bytes(16, 6)]}
    done = _both(loop, parts, agreed)
    assert _whole(done[1], 0, parts[0]) and _whole(done[0], 1, parts[1])
    assert [n for kind, peer, n in loop.events[0] if kind == "post send"][1:3] == [1, 1]  # the fillers
    assert _recv_events(loop, 1) == ["post recv"] * 3 + ["wait recv"] * 3 + ["post recv"] * 2 + ["wait recv"] * 2
    assert agreed[1].expected == {0: [8, 24]} and agreed[0].sent == {1: [8, 24]}
    parts = {0: [_bytes(8, 7), _bytes(24, 8)], 1: [_bytes(8, 9), _bytes(16, 1)]}
    done = _both(loop, parts, agreed)
    assert _whole(done[1], 0, parts[0]) and _recv_events(loop, 1) == ["post recv"] * 3 + ["wait recv"] * 3


def test_a_preamble_says_how_its_parts_follow(loop: Loop, monkeypatch: pytest.MonkeyPatch) -> None:
    """The form each sender wrote: after the preamble with nothing agreed, as posted, filled when a length moved."""
    seen: list[int] = []
    real = loop.isend

    def isend(t: torch.Tensor, group_dst: int, group: Rank) -> Any:
        if group.rank == 0 and t.numel() == snapshot_exchange.preamble_size(2):
            seen.append(snapshot_exchange.read_preamble(t, 2)[2])
        return real(t, group_dst, group)

    monkeypatch.setattr(snapshot_exchange.dist, "isend", isend)
    agreed = {0: Agreed(), 1: Agreed()}
    for n in (16, 16, 24):
        _both(loop, {r: [_bytes(8, r), _bytes(n if r == 0 else 16, r)] for r in (0, 1)}, agreed)
    assert seen == [AFTER, AS_POSTED, FILLED]


def test_two_sides_out_of_step_are_refused_saying_so(loop: Loop) -> None:
    """A receiver that posted its parts, from a sender that agreed nothing: refused by name, before any part is
    taken for another, and the receiver forgets its lengths (the run fails; its next generation starts over)."""
    agreed = {0: Agreed(), 1: Agreed(expected={0: [8, 16]})}
    parts = {r: [_bytes(8, r), _bytes(16, r)] for r in (0, 1)}
    done = _both(loop, parts, agreed, timeout=5.0)
    assert [str(e) for e in done[1].failed] == [
        "the snapshots' copy from group rank 0 is out of step: it sent its parts as if nothing were posted, and "
        "this rank posted its parts with the preamble"
    ]
    assert agreed[1].expected == {}
    with pytest.raises(PipelineError, match=r"its parts' lengths \[8, 24\] are not the ones posted \(\[8, 16\]\)"):
        snapshot_exchange._check_form(0, AS_POSTED, [8, 16], [8, 24])


class _Snap:
    """What :func:`.snapshot_copies.send` reads of a snapshotter: one of two machines' ranks (group ranks 0, 1)."""

    def __init__(self, root: Path, rank: int) -> None:
        self.peers = Peers(["a", "b"], 1 - rank, [1 - rank])
        self.group, self.timeout, self.lineage = Rank(rank), 60.0, "ab12"
        self.priority = idle.Priority()
        self.folder = folders.machine_folder(root / f"machine{rank}", "run")
        self._written = folders.Written(self.folder, rank)
        self._received: dict[int, torch.Tensor] = {}
        self._maps, self._agreed = mapped.Files(), Agreed()
        self.dropped = False


def _copy(snaps: dict[int, _Snap], step: int, hinted: int | None) -> dict[int, tuple[bytes, bytes]]:
    """Both ranks copy their step-``step`` files to each other (``hinted``: the step each expects the other's to be)."""
    sent = {r: _payload(step, r, room=4096) for r in (0, 1)}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        head, body = sent[r]
        label = snapshot_copies.label(folders.file_name(step, "ab12", r), len(body))
        try:
            own = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            snapshot_copies.send(snaps[r], head, own, idle.Clock({}), label, hinted)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    return sent


def test_a_copy_posted_before_its_preamble_lands_in_its_files_pages_under_its_own_name(
    loop: Loop, tmp_path: Path
) -> None:
    """From the second snapshot on, each rank stages the other's file from the name it expects before the
    preamble is in, receives the bytes into its pages, and publishes it under the name the preamble carried -
    also when the expected name was wrong (no staged file is left behind)."""
    snaps = {r: _Snap(tmp_path, r) for r in (0, 1)}
    for step, hinted in ((7, 7), (8, 8), (9, 10)):
        sent = _copy(snaps, step, hinted)
        for r in (0, 1):
            other = 1 - r
            path = snaps[r].folder / folders.file_name(step, "ab12", other)
            assert path.read_bytes() == sent[other][0] + sent[other][1]
            assert torch.equal(tensors_of(*verified(path.read_bytes()))["model.w"], torch.arange(4.0) + other)
            st = path.stat()
            assert (st.st_dev, st.st_ino) in snaps[r]._maps.maps[other]  # received into its pages
            assert not [p for p in snaps[r].folder.iterdir() if p.name.endswith(".tmp")]
            if step > 7:
                assert _recv_events(loop, r)[:3] == ["post recv"] * 3  # (posted before the preamble was in)
        loop.events.clear()
    assert snaps[0]._received == {} and snaps[1]._received == {}  # nothing received into a buffer of its own
