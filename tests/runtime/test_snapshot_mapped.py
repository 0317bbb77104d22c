"""A snapshot file written in place (:mod:`stagewise.runtime.elastic.mapped`, issue 48 item 4): the fill lands in
the file's mapped pages, the head padded to a page-rounded room; the file reads back to the bit, is refused when
damaged, reads with the reader of before, and under its final name is never a half-written generation."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic import mapped
from stagewise.runtime.elastic.snapshot_file import (
    HEAD_FIXED,
    MAGIC,
    SnapshotRefused,
    fill_payload,
    head_need,
    header_bytes,
    layout_payload,
    read_header,
    tensors_of,
    verified,
)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(300, 7, dtype=torch.float64, generator=g),
        "model/b": torch.randn(7, dtype=torch.float64, generator=g),
        "optim/w/exp_avg": torch.randn(7, 300, dtype=torch.float64, generator=g).t(),  # not contiguous
        "optim/step": torch.tensor(float(seed), dtype=torch.float64),
    }


class Writer:
    """What a snapshotter's helper does for its own file, in place (``room``: kept between generations)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.files, self.room = folder, mapped.Files(), 0
        self.written = folders.Written(folder, 0)

    def stage(self, step: int, ts: dict[str, torch.Tensor]) -> tuple[mapped.Staged, bytes, Path]:
        entries, total = layout_payload(ts)
        header: dict[str, Any] = {"step": step, "lineage": "ab12", "owner": 0, "tensors": entries}
        self.room = mapped.room_for(head_need(header, total), self.room)
        name = folders.file_name(step, "ab12", 0)
        staged = self.files.stage(0, self.folder, name, self.written.spare(0), self.room, total)
        staged.mapping.places = fill_payload(staged.payload, ts, entries, staged.mapping.places)
        return staged, header_bytes(header, staged.payload, self.room), self.folder / name

    def write(self, step: int, ts: dict[str, torch.Tensor]) -> Path:
        staged, head, final = self.stage(step, ts)
        self.written.keep(0, mapped.publish(self.files, 0, staged, head, staged.payload, final))
        return final


def read(path: Path) -> dict[str, torch.Tensor]:
    return tensors_of(*verified(path.read_bytes()))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def test_a_file_written_in_place_reads_back_to_the_bit_and_its_pages_serve_every_third_generation(
    tmp_path: Path,
) -> None:
    w = Writer(tmp_path)
    inodes, maps = {}, {}
    for step in range(1, 6):
        path = w.write(step, state(step))
        assert same(read(path), state(step)), step
        inodes[step] = path.stat().st_ino
        maps[step] = w.files.maps[0][(path.stat().st_dev, inodes[step])]
        header, start = read_header(path.read_bytes())
        assert start == w.room and w.room % mapped.PAGE == 0 and header["step"] == step  # the head fills its room
    assert inodes[4] == inodes[1] and inodes[5] == inodes[2] and len(set(inodes.values())) == 3
    assert maps[4] is maps[1] and maps[5] is maps[2]  # the same pages, mapped once
    assert len(w.files.maps[0]) == 3
    assert sorted(p.name[:10] for p in tmp_path.glob("*.snap")) == ["0000000004", "0000000005"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [folders.spare_name(0, 0)]
    assert same(read(tmp_path / folders.file_name(4, "ab12", 0)), state(4))  # the older kept file is still whole


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "payload is corrupted"),
        (lambda b: b[:-8], "its payload is"),
        (lambda b: b[: HEAD_FIXED + 5], "header is cut short or corrupted"),
        (lambda b: b[:30], "its header is cut short"),
    ],
)
def test_a_damaged_file_written_in_place_is_refused(tmp_path: Path, damage: Any, words: str) -> None:
    data = Writer(tmp_path).write(3, state(3)).read_bytes()
    with pytest.raises(SnapshotRefused, match=words):
        verified(damage(data))


def test_every_byte_of_the_heads_padding_is_covered(tmp_path: Path) -> None:
    """The spaces after the JSON are in the header's digest: a flipped one is refused, like any other byte."""
    data = Writer(tmp_path).write(3, state(3)).read_bytes()
    _, start = read_header(data)
    padded = [at for at in range(HEAD_FIXED, start) if data[at : at + 1] == b" "]
    assert len(padded) > 100  # the head is padded
    for at in padded[:: max(len(padded) // 50, 1)]:
        with pytest.raises(SnapshotRefused, match="header is cut short or corrupted"):
            verified(data[:at] + b"!" + data[at + 1 :])


def test_the_reader_of_before_reads_a_padded_head_and_the_reader_now_reads_old_files(tmp_path: Path) -> None:
    """A file of before (no padding: its head as long as its JSON) and one written in place both read; the
    reader of before (JSON after a SHA-256-checked length) reads the padded head, as the JSON ends in spaces."""
    ts = state(2)
    entries, total = layout_payload(ts)
    buffer = torch.zeros(total, dtype=torch.uint8)
    fill_payload(buffer, ts, entries)
    old = header_bytes({"step": 2, "lineage": "ab12", "owner": 0, "tensors": entries}, buffer)
    assert same(tensors_of(*verified(old + buffer.numpy().tobytes())), ts)
    data = Writer(tmp_path).write(2, ts).read_bytes()
    assert data[: len(MAGIC)] == MAGIC
    (length,) = struct.unpack("<Q", data[len(MAGIC) : len(MAGIC) + 8])
    text = data[HEAD_FIXED : HEAD_FIXED + length]
    assert hashlib.sha256(text).digest() == data[len(MAGIC) + 8 : HEAD_FIXED] and text.endswith(b" ")
    header = json.loads(text)  # the reader of before: nothing more than this
    assert header["payload_bytes"] == total and same(tensors_of(header, memoryview(data)[HEAD_FIXED + length :]), ts)


def test_a_spare_written_over_is_never_a_half_written_generation_under_its_final_name(tmp_path: Path) -> None:
    """While generation 4 is written over the spare (generation 1's file), its final name does not exist, the
    folder lists only the whole generations 2 and 3, and they read; published, it reads whole. A staged file
    thrown away (its bytes failed) leaves nothing, and its pages are not reused."""
    w = Writer(tmp_path)
    for step in (1, 2, 3):
        w.write(step, state(step))
    staged, head, final = w.stage(4, state(4))
    assert not final.exists() and staged.staging.name.startswith(".")
    found, refused = folders.inventory(tmp_path)
    assert [f.header["step"] for f in found] == [2, 3] and refused == []
    assert same(read(tmp_path / folders.file_name(3, "ab12", 0)), state(3))
    w.written.keep(0, mapped.publish(w.files, 0, staged, head, staged.payload, final))
    assert same(read(final), state(4))
    staged, _, final = w.stage(5, state(5))
    mapped.discard(w.files, 0, staged)
    assert not final.exists() and not staged.staging.exists() and staged.key not in w.files.maps[0]


def test_a_head_that_outgrew_its_room_is_written_the_old_way(tmp_path: Path) -> None:
    """(A header that grew past its room between the room's choice and the head: the file is still whole.)"""
    w = Writer(tmp_path)
    staged, _, final = w.stage(3, state(3))
    entries, _ = layout_payload(state(3))
    big = {"step": 3, "lineage": "ab12", "owner": 0, "tensors": entries, "extra": "x" * (2 * staged.room)}
    head = header_bytes(big, staged.payload, staged.room)
    assert len(head) > staged.room
    mapped.publish(w.files, 0, staged, head, staged.payload, final)
    assert same(read(final), state(3)) and read_header(final.read_bytes())[0]["extra"] == big["extra"]
    assert staged.key not in w.files.maps[0]  # its mapping is not reused at the old size


def test_a_pipelines_files_are_written_in_place_and_read_back_its_parameters(one_rank: object, tmp_path: Path) -> None:
    """A pipeline's own files, step after step: each head fills a page-rounded room kept from step to step (sized
    from the last head), each file is one of three mapped once, and each holds the parameters of its step. A
    header that outgrows its room (a bigger ``extra``) is written the old way once, then the room grows."""
    import torch.nn.functional as F
    from torch import nn

    import stagewise as sw

    torch.manual_seed(0)
    pipe = sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 3, dtype=torch.float64)], loss_fn=F.cross_entropy, microbatches=1,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path), extra=lambda: {"blob": "x" * size[0]}),
    )  # fmt: skip
    snaps = pipe.snapshots
    assert snaps is not None
    x, y = torch.randn(2, 4, dtype=torch.float64), torch.tensor([0, 1])
    rooms, size, grown = set(), [10], {}
    for step in range(1, 6):
        pipe.train_step(x, y)
        snaps.wait()
        (path,) = snaps.folder.glob(f"{step:010d}-*.snap")
        header, start = read_header(path.read_bytes())
        rooms.add(start)
        st = path.stat()
        assert (st.st_dev, st.st_ino) in snaps._maps.maps[snaps.rank]  # written in place, its mapping kept
        back = read(path)
        params = [t for n, t in back.items() if n.startswith("model/")]
        assert params and all(t.dtype == torch.float64 for t in params)
        assert len(params) == len(list(pipe.parameters()))
        assert all(any(torch.equal(p.detach(), t) for t in params) for p in pipe.parameters())  # to the bit
    assert len(rooms) == 1 and rooms.pop() % mapped.PAGE == 0
    assert len(snaps._maps.maps[snaps.rank]) == 3
    size[0] = 3 * mapped.PAGE
    for step in (6, 7):
        pipe.train_step(x, y)
        snaps.wait()
        (path,) = snaps.folder.glob(f"{step:010d}-*.snap")
        st = path.stat()
        grown[step] = (read_header(path.read_bytes())[1], (st.st_dev, st.st_ino) in snaps._maps.maps[snaps.rank])
        assert all(any(torch.equal(p.detach(), t) for t in read(path).values()) for p in pipe.parameters())
    assert not grown[6][1] and grown[7][1] and grown[7][0] > 3 * mapped.PAGE  # once the old way, then in place
