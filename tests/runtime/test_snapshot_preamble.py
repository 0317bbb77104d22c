"""A snapshot copy's wire (issue 48 item 4, the snapshot's cost): one preamble, then every part posted at once.

A gloo send moves only once its receive is posted, and on a rank with no spare core the threads that post run
in the core's idle time: each message that waits for the one before costs a round of both ranks' idle moments.
So the preamble says every part's length (and the note a receiver stages its file from) in one fixed-size
message, and the receiver posts every part before it waits for any. The fake wire below lets the head's receive
end only once the bytes' receive was posted too."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from helpers.fake_wire import Done
from stagewise.runtime.comm import snapshot_exchange, snapshot_wire
from stagewise.runtime.errors import PipelineError


def test_a_preamble_reads_back_every_length_and_the_note() -> None:
    parts = [
        torch.zeros(5, dtype=torch.uint8),
        None,
        torch.zeros(0, dtype=torch.uint8),
        torch.zeros(2, dtype=torch.uint8),
    ]
    data = snapshot_exchange.preamble(parts, b"step-7 42\n")
    assert data.dtype == torch.uint8 and data.numel() == 8 * 6 + snapshot_exchange.NOTE_BYTES  # (fixed: 4 parts)
    assert data.numel() == snapshot_exchange.preamble_size(4)
    assert snapshot_exchange.read_preamble(data, 4) == ([5, -1, 0, 2], b"step-7 42\n", snapshot_exchange.AFTER)
    one = snapshot_exchange.preamble([None], b"", snapshot_exchange.FILLED)
    assert snapshot_exchange.read_preamble(one, 1) == ([-1], b"", snapshot_exchange.FILLED)
    # the lengths little-endian on any machine (a big-endian peer reads what a little-endian one sent)
    assert bytes(data[:16].tolist()) == (5).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True)


def test_a_note_too_long_is_refused_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    monkeypatch.setattr(snapshot_wire.dist, "isend", lambda *a, **k: sent.append(a) or Done())
    with pytest.raises(
        ValueError, match=f"at most {snapshot_exchange.NOTE_BYTES} bytes, got {snapshot_exchange.NOTE_BYTES + 1}"
    ):
        snapshot_exchange.exchange_parts([None], 0, [], None, 1.0, note=b"x" * (snapshot_exchange.NOTE_BYTES + 1))
    assert sent == []


def test_a_preamble_whose_note_length_is_out_of_range_is_a_failure() -> None:
    data = snapshot_exchange.preamble([None], b"ok")
    data[16:24] = torch.tensor(list((snapshot_exchange.NOTE_BYTES + 1).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(PipelineError, match="a preamble whose note is"):
        snapshot_exchange.read_preamble(data, 1)
    data = snapshot_exchange.preamble([None], b"ok")
    data[8:16] = torch.tensor(list((7).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(PipelineError, match=r"a preamble of an unknown form \(7\)"):
        snapshot_exchange.read_preamble(data, 1)


class _Wire:
    """The source (group rank 2) sends a 3-byte head and a 4-byte body; the head's receive ends only once the
    body's receive was posted (within ``patience`` s, else it fails saying so)."""

    def __init__(self, patience: float) -> None:
        self.patience, self.posted, self.body_posted = patience, list[tuple[str, int]](), threading.Event()
        self.head, self.body = b"abc", b"wxyz"
        self.places: list[tuple[int, bytes, int, int]] = []

    def irecv(self, t: torch.Tensor, group_src: int, group: Any) -> Any:
        self.posted.append(("recv", t.numel()))
        if len(self.posted) == 1:  # the preamble
            sizes = [torch.empty(3, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)]
            t.copy_(snapshot_exchange.preamble(sizes, b"the note"))
            return Done()
        if t.numel() == 4:
            t.copy_(torch.frombuffer(bytearray(self.body), dtype=torch.uint8))
            self.body_posted.set()
            return Done()
        t.copy_(torch.frombuffer(bytearray(self.head), dtype=torch.uint8))
        outer = self

        class _Head:
            def wait(self, timeout: Any = None) -> bool:
                if not outer.body_posted.wait(outer.patience):
                    raise RuntimeError("the head was waited for before the bytes' receive was posted")
                return True

        return _Head()

    def isend(self, t: torch.Tensor, group_dst: int, group: Any) -> Any:
        self.posted.append(("send", t.numel()))
        return Done()


def test_the_receiver_posts_every_part_before_it_waits_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Head and bytes are both posted once the preamble is in, each where ``place`` says (asked with the source,
    the note, the part's index and length), and both arrive whole."""
    w = _Wire(patience=10.0)
    monkeypatch.setattr(snapshot_wire.dist, "irecv", w.irecv)
    monkeypatch.setattr(snapshot_wire.dist, "isend", w.isend)
    into = torch.zeros(8, dtype=torch.uint8)

    def place(source: int, note: bytes, index: int, n: int) -> torch.Tensor | None:
        w.places.append((source, note, index, n))
        return into if index == 1 else None

    done = snapshot_exchange.exchange_parts([None, None], None, [2], None, 60.0, place)
    assert done.failed == [] and done.ended == {2}
    head, body = done.parts[2]
    assert head.numpy().tobytes() == b"abc" and body.numpy().tobytes() == b"wxyz"
    assert body.data_ptr() == into.data_ptr()  # received where place said
    assert w.places == [(2, b"the note", 0, 3), (2, b"the note", 1, 4)]
    assert w.posted == [("recv", snapshot_exchange.preamble_size(2)), ("recv", 3), ("recv", 4)]
