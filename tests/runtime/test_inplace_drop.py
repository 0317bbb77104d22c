"""sw.runtime.InPlace's side of a recovery, in one process: the failed pipeline's tensors go at once (only its
process groups are held until their timeout), and what it cannot take over in place is refused by name."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.checkpoint import state
from stagewise.runtime.comm import release
from stagewise.runtime.relayout import generation
from stagewise.runtime.relayout.sources import in_place_refusal
from stagewise.runtime.relayout.takeover import hold


class _Boom(RuntimeError):
    pass


def _failing_pipeline(tmp_path: Path, fail_at: int) -> tuple[sw.Pipeline, Any]:
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == fail_at:  # (in the middle of a step: micro-batches in flight)
            raise _Boom("the step fails")
        return F.cross_entropy(out, y)

    layers = [sw.Layer(nn.Linear, 4, 8), sw.Layer(nn.BatchNorm1d, 8), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 8, 3)]
    pipe = sw.Pipeline(
        layers, loss_fn=loss, microbatches=2, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.1),
        snapshot=sw.Snapshots(every=1, folder=str(tmp_path)), timeout=5,
    )  # fmt: skip
    return pipe, torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def _tensor_refs(pipe: sw.Pipeline) -> dict[str, weakref.ref[torch.Tensor]]:
    """Weak references to every tensor the pipeline holds that a recovery must not keep twice."""
    refs = {f"model/{n}": weakref.ref(t) for n, t in state.load_targets(pipe).items()}
    refs |= {f"param/{n}": weakref.ref(p) for n, p in pipe.named_parameters()}
    refs |= {f"grad/{n}": weakref.ref(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}
    for s, opt in pipe.optimizers.items():
        for i, entries in enumerate(opt.state.values()):
            refs |= {f"optim/{s}/{i}/{k}": weakref.ref(v) for k, v in entries.items() if isinstance(v, torch.Tensor)}
    assert pipe.snapshots is not None
    for step, mark in pipe.snapshots.marks.items():
        refs |= {f"mark/{step}/{n}": weakref.ref(c) for n, c in mark.copies.items()}
    return refs


def test_a_failed_pipeline_lets_go_of_its_tensors_at_once_and_only_its_groups_are_held(
    one_rank: object, tmp_path: Path
) -> None:
    """The recovery's drop, as sw.runtime.InPlace runs it after a failed step: the release thread holds the process
    groups and their stores until their timeout, nothing else; every tensor of the failed pipeline is freed at once
    (no garbage collection: it is disabled here), but the ones the take-over kept for the new layout to alias
    (:func:`hold`), which go with them."""
    pipe, x = _failing_pipeline(tmp_path, fail_at=6)
    y = torch.tensor([0, 1, 2, 0])
    for _ in range(2):
        pipe.train_step(x, y)
    refs = _tensor_refs(pipe)
    job = generation.InPlace(sw.ElasticLayout(pp=1, batch=4, microbatch_size=2), lambda fit: None, tmp_path, timeout=5)
    gc.collect()
    gc.disable()
    try:
        try:
            pipe.train_step(x, y)  # fails in its second micro-batch
        except _Boom as err:
            job.pipe, pipe = pipe, None  # type: ignore[assignment]
            held = hold(job.pipe)
            assert held is not None
            job._drop_pipeline(err)
        kept = {id(t) for t in held.tensors.values()}
        values = {n: t.clone() for n, t in held.tensors.items()}
        alive = sorted(n for n, r in refs.items() if r() is not None and id(r()) not in kept)
        assert alive == [], f"the failed pipeline's tensors are still alive: {alive}"
        assert all(torch.equal(held.tensors[n], v) for n, v in values.items())  # the take-over's, untouched
        with release._cond:
            holding = [obj for _, obj in release._held]
        assert holding and all(isinstance(g, tuple) and not _has_tensors(g) for g in holding[-1]), holding
        del held, values
        alive = sorted(n for n, r in refs.items() if r() is not None)
        assert alive == [], f"tensors alive once the take-over's hold went: {alive}"
    finally:
        gc.enable()


def test_the_drop_never_empties_an_object_the_user_gave(one_rank: object, tmp_path: Path) -> None:
    """A user may hand the same config to every generation's build: the failed pipeline's drop empties the
    engine's own parts, never an instance of a public class (it may be the user's)."""
    config = sw.runtime.MetricsConfig(str(tmp_path / "metrics"), tensorboard=False)
    layers = [sw.Layer(nn.Linear, 4, 3)]
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, metrics=config)
    pipe.train_step(torch.randn(4, 4), torch.tensor([0, 1, 2, 0]))
    before = dict(vars(config))
    job = generation.InPlace(sw.ElasticLayout(pp=1, batch=4, microbatch_size=2), lambda fit: None, tmp_path, timeout=5)
    job.pipe = pipe
    job._drop_pipeline(None)
    assert vars(config) == before and config.dir == str(tmp_path / "metrics")
    sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=2, metrics=config)  # the next generation's build


def _has_tensors(obj: Any) -> bool:
    return any(isinstance(o, torch.Tensor) for o in (obj if isinstance(obj, tuple) else (obj,)))


def test_what_in_place_cannot_take_over_is_refused_by_name() -> None:
    """A HetPipe (not a Pipeline's state) at once; a pipeline of given stages whose placement a new membership
    changes (its tensors are named by stage); the same placement, or a layer list's any, goes on."""
    two = {"ranks": 2, "placement": [0, 1], "virtual_stages": 1}
    three = {"ranks": 3, "placement": [0, 1, 2], "virtual_stages": 1}
    why = in_place_refusal("HetPipe", None, None)
    assert why is not None and "HetPipe" in why and "build(fit) returned" in why
    why = in_place_refusal("given", three, two)
    assert why is not None and "from_stages" in why and "placement" in why and "'ranks': 3" in why
    assert in_place_refusal("given", two, dict(two)) is None
    assert in_place_refusal("given", None, two) is None  # the first generation
    assert in_place_refusal("pipeline", three, two) is None

    class HetPipe:  # (a stand-in: not a Pipeline's declared state)
        pass

    with pytest.raises(generation.InPlaceRefused, match="returned a HetPipe"):
        generation._refused(HetPipe(), None)


def test_a_pipeline_of_given_stages_is_refused_when_its_placement_changes(one_rank: object) -> None:
    """The placement InPlace compares is the pipeline's own (a one-rank from_stages pipeline: one stage on rank 0)."""
    pipe = sw.Pipeline.from_stages({0: nn.Linear(4, 3)}, loss_fn=F.cross_entropy, microbatches=1)
    placed = generation._refused(pipe, None)
    assert placed == {"ranks": 1, "placement": [0], "virtual_stages": 1}
    assert generation._refused(pipe, placed) == placed
    with pytest.raises(generation.InPlaceRefused, match="from_stages"):
        generation._refused(pipe, {"ranks": 2, "placement": [0, 1], "virtual_stages": 1})


_STAMPING = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from stagewise.runtime.elastic import membership as ms
from stagewise.runtime.relayout import generation
ms.STAMP_S = 0.0  # a stamp always in flight, as a slow store host makes likely
port, wait = int(sys.argv[1]), timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait, wait_for_workers=False)
ms.stamping_until_exit(ms.Membership(dist.PrefixStore(sys.argv[2], store), 0, [0]).start())
time.sleep(0.2)
"""


def test_a_worker_whose_membership_stamps_leaves_in_order() -> None:
    """At exit the membership's thread is stopped while Python is whole (as InPlace.start has it): a store call that
    returned while the interpreter finalizes ended the thread inside torch's C++ frames, and the process aborted
    after training to the end ("terminate called without an active exception"; 6 of 10 such exits without it)."""
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    for k in range(2):
        run = [sys.executable, "-c", _STAMPING, str(host.port), f"job{k}/"]
        done = subprocess.run(run, capture_output=True, text=True, timeout=120)
        assert (done.returncode, "terminate" in done.stderr) == (0, False), done.stderr[-2000:]


def test_a_relayout_snapshots_with_a_snapshotter_of_its_own_layout(one_rank: object, tmp_path: Path) -> None:
    """The snapshotter keeps its pipeline's parameter names and layout from its first capture (they never change in
    a pipeline's life); a re-layout builds a new pipeline, and with it a new snapshotter, whose files say the new
    layout and name the new pipeline's tensors (one kept by mistake would describe the old layout's cut), going on
    from the old one's step under the job's name. (Before: the new snapshotter read the pipeline it was built for,
    emptied by the re-layout - the next step failed - and counted its steps from 0 again.)"""
    from stagewise.runtime.elastic.folder import inventory

    pipe, x = _failing_pipeline(tmp_path, fail_at=-1)
    y = torch.tensor([0, 1, 2, 0])
    pipe.train_step(x, y)
    first = pipe.snapshots
    assert first is not None
    job = first.job
    pipe.relayout(microbatches=1)
    assert pipe.snapshots is not None and pipe.snapshots is not first
    pipe.train_step(x, y)
    pipe.snapshots.wait()
    newest = max(inventory(pipe.snapshots.folder)[0], key=lambda f: f.header["step"])
    assert (newest.header["step"], newest.header["job"]) == (2, job)  # counted on, under the job's name
    assert newest.header["layout"] == state.layout_of(pipe, 1)
    assert newest.header["layout"]["pipeline"]["microbatches"] == 1
    assert set(newest.header["optimizer"]["params"]) == {n for n, _ in pipe.named_parameters()}
