"""A snapshot's fixed costs, kept from one to the next (issue 48 item 4, the small GPT's extra CPU per step):
the payload's layout and its JSON kept while the tensors' names, dtypes and shapes hold; the header's JSON
spliced from it, the same bytes as a whole dump; the head sent with a label naming its file, so the receiver
stages it without parsing the header (its digest still checked); the generators' states encoded in one call."""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from runtime.test_snapshot_giveup import _payload, _Snap, wire  # noqa: F401 (the fake wire and its fixture)
from stagewise.runtime.checkpoint import state
from stagewise.runtime.comm import snapshot_exchange
from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic import idle, snapshot_copies
from stagewise.runtime.elastic.snapshot_file import (
    HEAD_FIXED,
    SnapshotRefused,
    fill_payload,
    header_bytes,
    layout_for,
    layout_payload,
    read_header,
    tensors_of,
    verified,
)


def tensors(rows: int, cols: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, dtype=torch.float64, generator=g, requires_grad=True)
    return {
        "model.w": w,
        "model.b": torch.randn(5, dtype=torch.float64, generator=g),
        "optim.step": torch.tensor(3.0),
    }


def snapshot(ts: dict[str, torch.Tensor], kept: Any, step: int) -> tuple[Any, bytes]:
    """What the helper does: the layout (kept while it holds), the fill, the head with the kept JSON."""
    layout = layout_for(kept, ts)
    buffer = torch.zeros(layout.total, dtype=torch.uint8)
    fill_payload(buffer, ts, layout.entries)
    header = {"step": step, "lineage": "ab12", "owner": 0, "tensors": layout.entries}
    return layout, header_bytes(header, buffer, 0, layout) + buffer.numpy().tobytes()


def test_a_kept_layout_serves_only_the_same_shapes_and_reads_back_to_the_bit() -> None:
    """Three generations: (2, 3), again (2, 3) (the layout kept), then (3, 2), the same bytes in another shape
    (a new layout): each reads back to the bit in float64, in its own shape."""
    kept = None
    for step, (rows, cols) in enumerate([(2, 3), (2, 3), (3, 2)]):
        ts = tensors(rows, cols, step)
        layout, data = snapshot(ts, kept, step)
        assert (layout is kept) == (step == 1)
        kept = layout
        back = tensors_of(*verified(data))
        for name, t in ts.items():
            assert back[name].dtype == t.dtype and back[name].shape == t.shape
            assert torch.equal(back[name], t.detach())
        assert not ts["model.w"].grad_fn and ts["model.w"].requires_grad  # (the fill records no history)


def test_the_spliced_header_is_the_same_bytes_as_a_whole_dump() -> None:
    ts = tensors(4, 5, 0)
    layout = layout_for(None, ts)
    buffer = torch.zeros(layout.total, dtype=torch.uint8)
    fill_payload(buffer, ts, layout.entries)
    header = {"step": 9, "lineage": "ab12", "owner": 1, "extra": {"x": [1.5, None]}, "tensors": layout.entries}
    for room in (0, 4096):
        assert header_bytes(header, buffer, room, layout) == header_bytes(header, buffer, room)


def test_a_layout_not_the_headers_own_is_not_spliced() -> None:
    """The header's ``tensors`` is another dict than the layout's: the header's own is written."""
    layout = layout_for(None, tensors(2, 3, 0))
    other, total = layout_payload(tensors(3, 2, 0))
    header = {"step": 1, "lineage": "ab12", "owner": 0, "tensors": other}
    head = header_bytes(header, torch.zeros(total, dtype=torch.uint8), 0, layout)
    assert read_header(head)[0]["tensors"] == other


def test_a_label_names_a_file_and_anything_else_is_not_a_label() -> None:
    name = folders.file_name(7, "ab12", 4)
    assert snapshot_copies._labelled(snapshot_copies.label(name, 64)) == (name, 64)
    assert snapshot_copies._labelled(b"") is None  # (a copy sent without one)
    for bad in ("../0000000007-ab12-r00004.snap", ".0000000007-ab12-r00004.snap.tmp", "x.snap"):
        assert snapshot_copies._labelled(f"{bad} 64\n".encode()) is None
    assert snapshot_copies._labelled(f"{name} 6x4\n".encode()) is None


def test_labelled_copies_are_staged_from_their_labels_and_read_back_whole(
    wire: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sources' copies come labelled (in their preambles): each lands under its label's name, its head at its
    start, and reads back; this rank's own label goes in its preamble, its head unlabelled."""
    snap = _Snap(tmp_path)
    heads, bodies = {}, {}
    for src in (2, 4):
        heads[src], bodies[src] = _payload(7, src)
    w = wire(silent=99, heads=heads, bodies=bodies)
    sent: list[bytes] = []

    def isend(t: torch.Tensor, group_dst: int, group: Any) -> Any:
        sent.append(t.numpy().tobytes())
        return w.isend(t, group_dst, group)

    monkeypatch.setattr(dist, "isend", isend)  # (the module snapshot_wire calls)
    own_head, own_body = _payload(7, 1)
    own_label = snapshot_copies.label(folders.file_name(7, "ab12", 1), len(own_body))
    snapshot_copies.send(
        snap, own_head, torch.frombuffer(bytearray(own_body), dtype=torch.uint8), idle.Clock({}), own_label
    )
    pre = snapshot_exchange.preamble([torch.empty(len(own_head)), torch.empty(len(own_body))], own_label)
    assert sent[:2] == [pre.numpy().tobytes(), own_head]  # the label in the preamble, the head as it is
    for src in (2, 4):
        path = snap.folder / folders.file_name(7, "ab12", src)
        assert path.read_bytes() == heads[src] + bodies[src]
        assert torch.equal(tensors_of(*verified(path.read_bytes()))["model.w"], torch.arange(4.0) + src)
        st = path.stat()
        assert (st.st_dev, st.st_ino) in snap._maps.maps[src]  # received into its file's pages, as labelled


def test_a_labelled_head_whose_digest_fails_is_refused_and_no_file_is_left(wire: Any, tmp_path: Path) -> None:  # noqa: F811
    """The label reads (the file is staged from it before the head is in), the head's JSON is flipped on the way:
    the copy is refused once the head is in, raised after the other source's copy is written, and the folder
    holds no file of it, whole or staged."""
    snap = _Snap(tmp_path)
    heads, bodies = {}, {}
    for src in (2, 4):
        heads[src], bodies[src] = _payload(7, src)
    label = snapshot_copies.label(folders.file_name(7, "ab12", 4), len(bodies[4]))
    flipped = bytearray(heads[4])
    flipped[HEAD_FIXED + 3] ^= 0x01
    heads[4] = bytes(flipped)
    w = wire(silent=99, heads=heads, bodies=bodies)
    w.labels[4] = label  # (the sender labelled its file before the head was spoiled)
    own_head, own_body = _payload(7, 1)
    with pytest.raises(SnapshotRefused):
        snapshot_copies.send(snap, own_head, torch.frombuffer(bytearray(own_body), dtype=torch.uint8), idle.Clock({}))
    names = sorted(p.name for p in snap.folder.iterdir())
    assert names == [folders.file_name(7, "ab12", 2)]  # rank 2's copy whole; rank 4's nowhere
    assert not snap._maps.maps.get(4)  # its staged file let go


def test_the_generators_states_encode_as_before_and_restore() -> None:
    t = torch.get_rng_state()
    assert state._b64(t) == base64.b64encode(bytes(t.tolist())).decode("ascii")
    saved = state.rng_state()
    kind, keys, *_ = np.random.get_state(legacy=True)
    assert saved["numpy"][1] == [int(k) for k in keys] and all(type(k) is int for k in saved["numpy"][1])
    want = (torch.rand(3), random.random(), np.random.rand())
    state.set_rng_state(saved)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
