"""What keeps a snapshot after every step cheap (issue 48 item 4), as facts, not timings: the snapshot's threads
run at ``SCHED_IDLE`` (only in the core's idle time) and at the ordinary policy while the step waits for them;
a retired generation's file is written over (its memory pages reused) and never listed or pruned as a
snapshot; the peers' copies arrive in buffers kept from snapshot to snapshot."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.runtime.comm import snapshot_exchange
from stagewise.runtime.elastic import folder as folders
from stagewise.runtime.elastic import idle

linux = pytest.mark.skipif(idle.POLICY is None, reason="SCHED_IDLE is Linux's")


@linux
def test_a_helper_thread_is_idle_and_raised_only_while_waited_for() -> None:
    priority = idle.Priority()
    seen: list[int | None] = []
    go, done = threading.Event(), threading.Event()

    def helper() -> None:
        seen.append(priority.enter())
        go.set()
        done.wait(10)

    thread = threading.Thread(target=helper)
    thread.start()
    go.wait(10)
    tid = thread.native_id
    assert tid is not None
    assert seen == [os.SCHED_IDLE] and os.sched_getscheduler(tid) == os.SCHED_IDLE
    with priority.raised_while():
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy untouched
    priority.leave()  # the helper is done: its id is never touched again (ids are reused)
    with priority.raised_while():
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    done.set()
    thread.join(10)


@linux
def test_a_pipelines_snapshot_threads_run_idle_and_its_files_are_written_over(one_rank: object, tmp_path: Path) -> None:
    import torch.nn.functional as F
    from torch import nn

    pipe = sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 3)], loss_fn=F.cross_entropy, microbatches=1,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), snapshot=sw.Snapshots(every=1, folder=str(tmp_path)),
    )  # fmt: skip
    snaps = pipe.snapshots
    assert snaps is not None
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    inodes = {}
    assert pipe.committed_step == 0
    for step in range(1, 5):
        pipe.train_step(x, y)
        assert pipe.committed_step in (step - 1, step)  # the step before is committed; its own is on its way
        snaps.wait()
        assert pipe.committed_step == step
        (mine,) = snaps.folder.glob(f"{step:010d}-*.snap")
        inodes[step] = mine.stat().st_ino
    assert snaps.policy == os.SCHED_IDLE  # the helper thread, as it ran
    assert snaps.priority.group, "the snapshot group's gloo threads were not found"
    assert all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in snaps.priority.group)
    assert inodes[4] == inodes[1] and len(set(inodes.values())) == 3  # step 1's file became step 4's
    assert sorted(p.name[:10] for p in snaps.folder.glob("*.snap")) == ["0000000003", "0000000004"]
    assert [p.name for p in snaps.folder.glob(".spare-*")] == [".spare-w00000-r00000"]  # step 2's, retired


def test_a_spare_is_written_over_whole_and_is_never_a_snapshot(tmp_path: Path) -> None:
    spare = tmp_path / folders.spare_name(0, 1)
    old = folders.write(tmp_path, folders.file_name(1, "ab", 1), b"head", memoryview(b"x" * 100))
    folders.retire(old, spare)
    assert not old.exists() and spare.stat().st_size == 104
    assert folders.inventory(tmp_path) == ([], []) and folders.prune(tmp_path, 10) == []  # not a snapshot
    new = folders.write(tmp_path, folders.file_name(3, "ab", 1), b"HEAD", memoryview(b"y" * 10), spare)
    assert new.read_bytes() == b"HEAD" + b"y" * 10 and not spare.exists()  # shorter: the rest cut off
    folders.retire(tmp_path / "gone.snap", spare)  # pruned by another rank first: nothing to retire
    again = folders.write(tmp_path, folders.file_name(4, "ab", 1), b"h", memoryview(b"z"), spare)
    assert again.read_bytes() == b"hz"  # no spare: a new file
    folders.retire(new, spare)
    folders.remove_spares(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [again.name]


def test_the_peers_copies_arrive_in_kept_buffers() -> None:
    keep: dict[int, torch.Tensor] = {}
    first = snapshot_exchange._buffer(keep, 3, 100)
    second = snapshot_exchange._buffer(keep, 3, 60)
    assert second.data_ptr() == first.data_ptr() and second.numel() == 60
    assert snapshot_exchange._buffer(keep, 3, 200).numel() == 200 and keep[3].numel() == 200


def test_a_rebound_root_is_read_anew(one_rank: object, tmp_path: Path) -> None:
    """A re-layout in place rebinds ``root``: the next capture names the new pipeline's parameters and layout,
    never what was kept of the old one (a parameter unknown to the old names would be misnamed)."""
    import torch.nn.functional as F
    from torch import nn

    from stagewise.runtime.checkpoint import state

    def build(layers: list[sw.Layer], snapshot: object, microbatches: int) -> sw.Pipeline:
        return sw.Pipeline(
            layers, loss_fn=F.cross_entropy, microbatches=microbatches,
            optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1), snapshot=snapshot,
        )  # fmt: skip

    old = build([sw.Layer(nn.Linear, 4, 3)], sw.Snapshots(every=1, folder=str(tmp_path)), 1)
    new = build([sw.Layer(nn.Linear, 4, 5), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 5, 3)], None, 2)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    old.train_step(x, y)
    new.train_step(x, y)
    snaps = old.snapshots
    assert snaps is not None
    snaps.wait()
    snaps.root = new
    capture = snaps._capture(None)
    assert capture.header["layout"] == state.layout_of(new, 1) != state.layout_of(old, 1)
    names = set(state.parameter_names(new).values())
    assert {k.split("/")[1] for k in capture.tensors if k.startswith("optim/")} == names


@pytest.mark.parametrize("commit", ["pipelined", "sync"])
def test_a_sync_commit_holds_each_step_before_train_step_returns(
    commit: str, one_rank: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Snapshots(commit="sync")``: ``train_step`` returns with its own step committed, however slow the copy
    (slowed here); pipelined, it returns with the step before committed and its own on its way."""
    import torch.nn.functional as F
    from torch import nn

    from stagewise.runtime.elastic import snapshot_file
    from stagewise.runtime.elastic import snapshots as snapshots_module

    fill = snapshot_file.fill_payload

    def slow(*args: object) -> object:
        time.sleep(0.2)
        return fill(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshots_module, "fill_payload", slow)
    pipe = sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 3)], loss_fn=F.cross_entropy, microbatches=1,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path), commit=commit),
    )  # fmt: skip
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    for step in range(1, 4):
        pipe.train_step(x, y)
        assert pipe.committed_step == (step if commit == "sync" else step - 1)


def test_a_capture_holds_the_parameters_live_the_buffers_copied_and_the_generators_as_taken(
    one_rank: object, tmp_path: Path
) -> None:
    """On the step's thread a capture takes the parameters by reference (the next step waits for their copy),
    copies the buffers (a forward changes BatchNorm's statistics), and takes the generators' states, which the
    helper encodes later: what it encodes is the state at the capture, not after draws made since."""
    import random

    import torch.nn.functional as F
    from torch import nn

    from stagewise.runtime.checkpoint import state

    pipe = sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 6), sw.Layer(nn.BatchNorm1d, 6), sw.Layer(nn.Linear, 6, 3)],
        loss_fn=F.cross_entropy, microbatches=1, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path)),
    )  # fmt: skip
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    pipe.train_step(x, y)
    snaps = pipe.snapshots
    assert snaps is not None
    snaps.wait()
    capture = snaps._capture(None)
    live = pipe.state_dict(keep_vars=True)
    params = {name for name, t in live.items() if isinstance(t, nn.Parameter)}
    assert params and len(params) < len(live)  # (weights and biases; BatchNorm's statistics and count)
    for name, t in live.items():
        got = capture.tensors[state.MODEL + name]
        assert torch.equal(got, t.detach()) and not got.requires_grad, name
        assert (got.data_ptr() == t.data_ptr()) == (name in params), name  # parameters live, buffers copied
    mean = next(n for n in live if n.endswith("running_mean"))
    kept = capture.tensors[state.MODEL + mean].clone()
    want = state.rng_state()
    pipe.train_step(x, y)  # a forward: the live statistics move; draws move the generators
    torch.rand(5), random.random()
    assert not torch.equal(live[mean], kept) and torch.equal(capture.tensors[state.MODEL + mean], kept)
    assert state.rng_encoded(capture.header["rng"]) == want != state.rng_state()


def test_a_group_added_or_a_state_set_after_the_capture_is_not_the_snapshot_s(one_rank: object, tmp_path: Path) -> None:
    """The user's code between two steps may unfreeze a layer (``add_param_group``) or set an optimizer state's
    entries anew while the helper still copies: the snapshot holds the groups and the state tensors of the step
    it is taken at (taken on the step's thread). A parameter the model lacks is refused at the capture."""
    import torch.nn.functional as F
    from torch import nn

    from stagewise.checkpoint import CheckpointError
    from stagewise.runtime.checkpoint import state

    def weights_only(ps: object) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in ps if p.dim() == 2], lr=0.1)  # type: ignore[attr-defined]

    pipe = sw.Pipeline(
        [sw.Layer(nn.Linear, 4, 3)], loss_fn=F.cross_entropy, microbatches=1, optimizer=weights_only,
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path)),
    )  # fmt: skip
    pipe.train_step(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    snaps = pipe.snapshots
    assert snaps is not None
    snaps.wait()
    capture = snaps._capture(None)
    (opt,) = state.optimizers_of(pipe, None)
    (weight,) = opt.param_groups[0]["params"]
    taken = opt.state[weight]["exp_avg"]
    bias = next(p for p in pipe.parameters() if p.dim() == 1)
    opt.add_param_group({"params": [bias], "lr": 0.3})  # the user unfreezes the bias
    opt.state[weight].update({k: v.clone() + 1 for k, v in opt.state[weight].items()})  # ... and resets a state
    name = state.parameter_names(pipe)[id(weight)]
    params = capture.header["optimizer"]["params"]
    assert set(params) == {name} and params[name]["lr"] == 0.1
    assert capture.tensors[f"{state.OPTIM}{name}/exp_avg"] is taken
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})  # not the model's: refused at the capture
    with pytest.raises(CheckpointError, match="that the model does not have"):
        snaps._capture(None)
