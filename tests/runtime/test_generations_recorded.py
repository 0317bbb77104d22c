"""The membership generation a state was trained in, recorded with it and fed to the one choice of the newest state
(runtime/comm/generations.py, the snapshot header, the checkpoint record; checkpoint/newest.py's rule 2).

Each writer is checked by reading back what it wrote (a writer that records 0 fails), and the take-over's
decision is checked to take the generation from each source's own record: the snapshots' headers, the disk's
record, the survivors' old pipeline."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.checkpoint.manifest import generation_of as recorded_in
from stagewise.runtime.checkpoint.verify import META
from stagewise.runtime.comm import generations as G
from stagewise.runtime.elastic.choose import Need, choose
from stagewise.runtime.elastic.snapshot_file import MAGIC, generation_of, header_bytes, read_header
from stagewise.runtime.relayout.sources import as_copy, decide

A, B = "model/a.weight", "model/b.weight"


@pytest.fixture(autouse=True)
def fresh_count() -> Iterator[None]:
    """Each test starts at generation 0 and leaves it there (the count is the process's)."""
    G._joined[0], G._base[0] = 0, 0
    yield
    G._joined[0], G._base[0] = 0, 0


def at(generation: int) -> None:
    """This process in membership generation ``generation`` (what ``join_generation`` sets, without a group)."""
    G._joined[0] = generation


def test_a_restore_counts_on_so_that_the_recorded_generation_never_goes_down() -> None:
    assert G.recorded() == 0  # a job that never changes members records 0
    at(3)
    G.count_from(2)  # the usual take-over: generation 3 goes on from generation 2's state
    assert G.recorded() == 3
    G.count_from(1)  # from an older state (the disk's): still this generation's
    assert G.recorded() == 3
    at(0)
    G.count_from(5)  # a store started again (generations from 0) resumes a generation-5 state: counts on from 5
    assert G.recorded() == 5
    at(1)
    G.count_from(5)  # and its next change of members is past every state of the job before
    assert G.recorded() == 6


def test_a_snapshot_header_names_its_generation_and_an_old_file_reads_as_0() -> None:
    at(4)
    head = header_bytes({"step": 7, "lineage": "L"}, torch.zeros(3, dtype=torch.uint8))
    header, _ = read_header(head)
    assert header["generation"] == 4 and generation_of(header) == 4
    old = json.dumps({"step": 7, "lineage": "L", "payload_bytes": 0, "payload_sha256": ""}).encode()
    before = MAGIC + struct.pack("<Q", len(old)) + hashlib.sha256(old).digest() + old  # written before the field
    assert generation_of(read_header(before)[0]) == 0


def test_a_checkpoint_records_its_generation_and_a_resume_counts_on_from_it(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "stagewise.json").write_text(json.dumps({"step": 1, "tensors": {}}))
    assert recorded_in(tmp_path / "old", META) == 0  # a record saved before the field
    at(2)
    folder = sw.checkpoint.save(tmp_path / "ckpt", model, step=3, collective=False)
    assert recorded_in(folder, META) == 2
    at(0)  # a job started again (its store too): generation 0 resumes the generation-2 state
    info = sw.checkpoint.resume(tmp_path / "ckpt", model, collective=False)
    assert info is not None and info.step == 3
    assert G.recorded() == 2  # what it trains next is recorded past the state it resumed


def copy(machine: str, holder: int, owner: int, step: int, names: list[str], membership: int) -> dict[str, Any]:
    """A listed snapshot file, as the take-over's listing sends it (its header's generation as ``membership``)."""
    return {
        "machine": machine,
        "holder": holder,
        "path": f"/{machine}/{step}-g{membership}-r{owner}",
        "lineage": f"L{membership}",
        "step": step,
        "owner": owner,
        "world": 2,
        "layout": {"world": 2},
        "names": names,
        "job": "j",
        "membership": membership,
    }


def record(machine: str, need: list[str], live: dict[str, list[str]], copies: list[Any], held_in: int) -> Any:
    return {"machine": machine, "copies": copies, "ended": {}, "need": need, "live": live, "held_in": held_in}


def test_the_take_over_chooses_by_each_sources_recorded_generation() -> None:
    """Generation 2's files of step 4 and generation 1's (a branch given up) of step 5, both whole: step 4 of
    generation 2 is committed; the survivors' live tensors complete it only when their pipeline was of that
    generation; a checkpoint on disk of an older generation loses to it even with a newer step, one of a newer
    generation wins."""
    new = [copy("m0", 0, 0, 4, [A], 2), copy("m1", 1, 1, 4, [B], 2)]
    gave_up = [copy("m0", 0, 0, 5, [A], 1), copy("m1", 1, 1, 5, [B], 1)]
    everyone = [record("m0", [A], {"4": [A]}, new + gave_up[:1], 2), record("m1", [B], {"4": [B]}, gave_up[1:], 2)]
    d = decide(everyone, {"world": 3}, None)
    assert not isinstance(d, str), d
    assert (d.step, d.lineage, d.generation) == (4, "L2", 2)
    assert d.counts() == {"kept": 2, "live": 0, "snapshot": 0}  # generation 2's live tensors, kept
    behind = [dict(r, held_in=1) for r in everyone]  # their pipeline was generation 1's: not the state chosen
    d = decide(behind, {"world": 3}, None)
    assert not isinstance(d, str) and d.counts() == {"kept": 0, "live": 0, "snapshot": 2}, d
    disk_old = [dict(everyone[0], disk_generation=1), everyone[1]]
    d = decide(disk_old, {"world": 3}, 9)
    assert not isinstance(d, str) and d.step == 4, d  # an older generation's newer step: a branch given up
    disk_new = [dict(everyone[0], disk_generation=3), everyone[1]]
    assert "on disk" in str(decide(disk_new, {"world": 3}, 3))


def test_the_snapshots_choice_takes_the_newest_generation_before_the_newest_step() -> None:
    files = [as_copy(c) for c in (copy("m", 0, 0, 4, [A], 2), copy("m", 0, 0, 5, [A], 1))]
    choice = choose(files, [Need(0, "m", frozenset([A]))], {"world": 1}, set())
    assert choice is not None and (choice.step, choice.membership) == (4, 2)
