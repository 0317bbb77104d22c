"""A snapshot's bytes and a machine's folder of them, in one process: every dtype and shape comes back to the bit;
a flipped bit anywhere, a file cut short or not a snapshot at all is refused; files appear whole or not at all;
the old generations go. And ``snapshot=`` as an option: what it accepts and refuses."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic.config import snapshot_config
from stagewise.runtime.elastic.snapshot_file import (
    MAGIC,
    SnapshotRefused,
    fill_payload,
    header_bytes,
    host_bytes,
    layout_payload,
    tensors_of,
    verified,
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/w": torch.randn(3, 5, dtype=torch.float64, generator=g),
        "model/half": torch.randn(7, generator=g).to(torch.bfloat16),
        "model/mask": torch.rand(4, generator=g) > 0.5,
        "model/count": torch.tensor(5, dtype=torch.int64),
        "model/empty": torch.empty(0, 3),
        "optim/w/exp_avg": torch.randn(3, 5, dtype=torch.float64, generator=g).t(),  # not contiguous
    }


def encode(ts: dict[str, torch.Tensor], step: int = 4) -> bytes:
    entries, total = layout_payload(ts)
    buffer = torch.zeros(total, dtype=torch.uint8)
    fill_payload(buffer, ts, entries)
    head = header_bytes({"step": step, "lineage": "ab12", "owner": 3, "tensors": entries}, buffer)
    return head + buffer.numpy().tobytes()


def test_every_tensor_comes_back_to_the_bit() -> None:
    ts = tensors()
    header, payload = verified(encode(ts))
    assert header["step"] == 4 and header["owner"] == 3
    back = tensors_of(header, payload)
    assert sorted(back) == sorted(ts)
    for name, t in ts.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    assert all(e["offset"] % 64 == 0 for e in header["tensors"].values())  # any dtype's view is aligned


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "payload is corrupted"),
        (lambda b: b[:-10], "its payload is"),
        (lambda b: b[:60] + bytes([b[60] ^ 1]) + b[61:], "header is cut short or corrupted"),
        (lambda b: b[:30], "its header is cut short"),
        (lambda b: b"PK\x03\x04" + b[4:], "not a stagewise snapshot"),
    ],
)
def test_damage_anywhere_is_refused(damage, words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SnapshotRefused, match=words):
        verified(damage(encode(tensors())))


def test_every_flipped_byte_of_a_payload_is_refused_and_an_older_sha256_file_still_reads() -> None:
    """The payload's CRC-32 catches any error burst up to 32 bits: each byte of the payload flipped alone is
    refused; a file written before it (its payload's SHA-256 in the header) reads, and is refused when damaged."""
    data = encode(tensors())
    header, payload = verified(data)
    start = len(data) - len(payload)
    for at in range(start, len(data)):
        with pytest.raises(SnapshotRefused, match="payload is corrupted"):
            verified(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    old = {k: v for k, v in header.items() if k != "payload_crc32"}
    old["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    text = json.dumps(old).encode()
    before = MAGIC + struct.pack("<Q", len(text)) + hashlib.sha256(text).digest() + text + bytes(payload)
    back = tensors_of(*verified(before))
    assert all(torch.equal(back[n], t) for n, t in tensors().items())
    with pytest.raises(SnapshotRefused, match="payload is corrupted"):
        verified(before[:-1] + bytes([before[-1] ^ 1]))


def test_a_fill_reuses_its_places_only_for_the_same_layout_and_buffer() -> None:
    """The places kept from one fill serve the next of the same layout; another layout (a re-layout's) or another
    buffer gets its own, and every payload holds its tensors to the bit."""
    ts = tensors()
    entries, total = layout_payload(ts)
    buffer = torch.zeros(2 * total, dtype=torch.uint8)
    places = fill_payload(buffer, ts, entries)
    again = {n: t + 1 if t.dtype.is_floating_point else t for n, t in ts.items()}
    assert fill_payload(buffer, again, entries, places) is places
    back = tensors_of({"tensors": entries}, host_bytes(buffer[:total]))
    assert all(torch.equal(back[n], t) for n, t in again.items())
    other = {"model/w": torch.arange(6.0).reshape(2, 3), "model/v": torch.arange(4, dtype=torch.int32)}
    other_entries, other_total = layout_payload(other)
    for into in (buffer, torch.zeros(other_total, dtype=torch.uint8)):  # another layout, then another buffer
        places, kept = fill_payload(into, other, other_entries, places), places
        assert places is not kept
        back = tensors_of({"tensors": other_entries}, host_bytes(into[:other_total]))
        assert all(torch.equal(back[n], t) for n, t in other.items())


def test_a_folder_lists_whole_files_prunes_old_ones_and_reports_damaged_headers(tmp_path: Path) -> None:
    where = folders.machine_folder(tmp_path, "job/7 x")
    assert where.name == "stagewise-job_7_x"
    for step in (2, 4, 6):
        data = encode(tensors(), step)
        head_len = len(data) - layout_payload(tensors())[1]
        folders.write(where, folders.file_name(step, "ab12", 3), data[:head_len], memoryview(data[head_len:]))
    (where / ".0000000008-ab12-r00003.snap.tmp").write_bytes(b"half")  # a writer killed half-way
    (where / "0000000009-ab12-r00001.snap").write_bytes(b"SWSNAP1\n" + b"\x00" * 50)  # a damaged header
    found, refused = folders.inventory(where)
    assert [f.header["step"] for f in found] == [2, 4, 6]
    assert [p.name for p, _ in refused] == ["0000000009-ab12-r00001.snap"]
    removed = folders.prune(where, 4)
    assert sorted(p.name for p in removed) == ["0000000002-ab12-r00003.snap"]
    folders.prune(where, 10)
    assert sorted(p.name for p in where.iterdir()) == []  # the .tmp goes with the old ones


def test_snapshot_option() -> None:
    assert snapshot_config(3) == sw.Snapshots(every=3)
    assert snapshot_config(None) is None
    assert sw.Options(snapshot=2).snapshot == 2
    for bad, words in [(0, "snapshot must be a number of steps >= 1"), ("2", "snapshot must be"), (True, "snapshot")]:
        with pytest.raises(ValueError, match=words):
            sw.Options(snapshot=bad)
    with pytest.raises(ValueError, match="Snapshots.every must be an integer >= 1"):
        sw.Snapshots(every=0)
    with pytest.raises(TypeError, match="Snapshots.extra must be a function"):
        sw.Snapshots(extra=3)  # type: ignore[arg-type]
    assert sw.Snapshots().commit == "pipelined" and sw.Snapshots(commit="sync").commit == "sync"
    with pytest.raises(ValueError, match="Snapshots.commit must be one of 'pipelined', 'sync', got 'now'"):
        sw.Snapshots(commit="now")


def test_the_rendezvous_store_serves_clients_until_stopped() -> None:
    """``stagewise rendezvous``'s store: torch's agents reach it as a TCPStore client (set, get) until it stops."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from stagewise.runtime.comm.rendezvous_host import serve

    stop, ports = threading.Event(), []
    thread = threading.Thread(target=serve, args=("127.0.0.1", 0, stop, ports.append), daemon=True)
    thread.start()
    for _ in range(200):
        if ports:
            break
        threading.Event().wait(0.05)
    client = dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=10))
    client.set("round", "7")
    assert client.get("round") == b"7"
    stop.set()
    thread.join(10)
    assert not thread.is_alive()


def test_a_finished_job_is_marked_and_its_snapshots_go_even_when_its_pipeline_was_collected(
    one_rank: object, tmp_path: Path
) -> None:
    """A clean exit's work is held apart from the pipeline: a script whose ``main()`` returned has had its pipeline
    collected by then, and its snapshots must still go (they outlived a job after its restart otherwise)."""
    import gc

    import torch.nn.functional as F
    from torch import nn

    from stagewise.runtime.elastic import snapshots

    layers = [sw.Layer(nn.Linear, 4, 3)]
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, microbatches=1, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path)),
    )  # fmt: skip
    x = torch.randn(2, 4)
    for _ in range(3):
        pipe.train_step(x, torch.tensor([0, 1]))
    assert pipe.snapshots is not None
    pipe.snapshots.wait()
    where, job = pipe.snapshots.folder, pipe.snapshots.job
    assert sorted(p.name[:10] for p in where.glob("*.snap")) == ["0000000002", "0000000003"]
    del pipe
    gc.collect()
    ending = next(e for e in snapshots._ENDINGS if e.folder == where)  # what the interpreter's exit runs
    ending.release_at_exit()
    assert sorted(p.name for p in where.iterdir()) == [f"ended-{job}.json"]
    assert folders.ended(where) == {job: 3}


def test_a_resume_passes_over_the_snapshots_of_a_job_that_ended() -> None:
    from stagewise.runtime.elastic.choose import Copy, of_live_jobs

    def copy(job: str, step: int) -> Copy:
        return Copy("m0", 0, f"/shm/{job}-{step}", "ab", step, 0, 1, {}, frozenset({"model/w"}), job=job)

    kept, refused = of_live_jobs([copy("aa", 4), copy("bb", 6), copy("", 8)], {"bb": 12})
    assert [c.step for c in kept] == [4, 8]  # an unnamed (older) file is not refused
    assert {job: [c.step for c in cs] for job, cs in refused.items()} == {"bb": [6]}


def test_a_failure_is_one_line_naming_the_lost_machine() -> None:
    from stagewise.runtime.elastic.launch import FAST_RDZV, failure_line, refused

    silent = "global ranks 4, 5 stopped or died (no sign of life for 2.5 s): rank 0 ... the all-reduce failed"
    records = [{"rank": 0, "steps": 11, "message": silent}, {"rank": 1, "steps": 11, "message": "rank 0: relayed"}]
    line = failure_line(records, 2, 2, FAST_RDZV, "/tmp/tb/attempt-0")
    assert line.startswith("lost machine 2 (ranks 4-5) after step 11: this machine's 2 processes restart")
    assert "noticed in 3 s: about 10 s" in line and line.endswith("(2 restarts left); tracebacks: /tmp/tb/attempt-0")
    own = failure_line([{"rank": 1, "steps": 3, "message": "rank 1: ValueError: bad"}], 2, 0, {}, "/t")
    assert own.startswith("rank 1: ValueError: bad (after step 3): ") and "about 50 s" in own  # torch's defaults
    assert "\n" not in line + own
    assert refused([{"rank": 0, "refusal": True}, {"rank": 1, "refusal": True}], [0, 1])
    assert not refused([{"rank": 0, "refusal": True}], [0, 1])  # rank 1 did not say it refused
    assert not refused([{"rank": 0, "refusal": True}, {"rank": 1, "refusal": False}], [0, 1])


def test_machines_sharing_one_folder_are_refused_by_name(tmp_path: Path) -> None:
    """Two agents of one host on one memory folder took each other's files (a generation failed every two steps,
    58 times, 2026-12-06): the gathered identities refuse it, naming the machines and the way out; a folder per
    machine, ranks of one machine sharing theirs, or a folder not made yet pass."""
    shared, other = tmp_path / "shm", tmp_path / "shm2"
    shared.mkdir(), other.mkdir()
    one, two = folders.identity(shared), folders.identity(other)
    assert one and two and one != two and folders.identity(tmp_path / "absent") == ""
    assert folders.identity(Path(str(shared) + "/.")) == one  # another spelling of the same folder
    ranks = [{"machine": "0", "folder": one}, {"machine": "0", "folder": one}, {"machine": "1", "folder": one}]
    with pytest.raises(ValueError, match=r"machines 0, 1 keep their snapshots in one folder .*STAGEWISE_SNAPSHOT_DIR"):
        folders.refuse_shared(ranks, shared)
    folders.refuse_shared([{"machine": "0", "folder": one}, {"machine": "1", "folder": two}], shared)
    folders.refuse_shared([{"machine": "0", "folder": one}, {"machine": "0", "folder": one}], shared)
    folders.refuse_shared([{"machine": "0", "folder": ""}, {"machine": "1", "folder": ""}], shared)
