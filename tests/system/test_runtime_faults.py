"""Hang forensics on 4 gloo ranks: one rank dies (or hangs) mid-step; every other rank raises a PipelineError
naming the dead peer and its own place in the schedule, and exits, within the pipeline's timeout.

Each rank is a plain process started here (tests/system/scripts/fault_checks.py), around a TCPStore hosted by this
test, so each survivor's own report is visible (torchrun would tear the job down once a worker dies)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fault_checks as fc
import stagewise as sw
from helpers.torchrun import TRANSPORTS

WORKER = Path(fc.__file__)
WORLD, VICTIM = 4, 1
TIMEOUT = 5.0  # the pipeline's, in fault_checks.py
STARTUP = 40.0  # four interpreters importing torch on a busy 2-core machine
#: CI's time: these cases run in `make faults` only (each a 4-process job of 6-12 s; their shared-memory or
#: store twin runs in `make test`)
FAULTS = bool(os.environ.get("STAGEWISE_FAULTS"))
IN_FAULTS = "`make faults` (STAGEWISE_FAULTS=1); its twin runs in `make test`"


def host_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def run_ranks(
    out: Path,
    hang: bool,
    mesh: bool = False,
    victim: int = VICTIM,
    store: dist.TCPStore | None = None,
    job: str = "job",
    transport: str = "torch",
    extra: tuple[str, ...] = (),
    startup: float = STARTUP,
) -> tuple[dict[int, int | None], dict[int, str], dict[int, str]]:
    """Start every rank; return their exit codes (None: killed by us, or still running when the guard passed),
    reports and stderr. The guard (start-up and three timeouts) catches hangs; it is not a measured bound."""
    store = store or host_store()
    cmd = [sys.executable, str(WORKER), "--world", str(WORLD), "--port", str(store.port), "--victim", str(victim)]
    cmd += ["--job", job, *extra]
    cmd += ["--out", str(out)] + (["--hang"] if hang else []) + (["--mesh"] if mesh else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STAGEWISE_TRANSPORT=transport)
    started = time.perf_counter()
    procs = {
        r: subprocess.Popen([*cmd, "--rank", str(r)], env=env, stderr=subprocess.PIPE, text=True) for r in range(WORLD)
    }
    codes: dict[int, int | None] = {}
    logs: dict[int, str] = {}
    try:
        for r, p in procs.items():
            if (hang or mesh) and r == victim and victim >= 0:
                continue
            try:
                p.wait(timeout=max(1.0, startup + 3 * TIMEOUT - (time.perf_counter() - started)))
                codes[r] = p.returncode
            except subprocess.TimeoutExpired:
                codes[r] = None
    finally:
        for r, p in procs.items():
            if p.poll() is None:
                p.kill()
                codes.setdefault(r, None)
            elif r not in codes:
                codes[r] = p.returncode
            logs[r] = p.communicate()[1]
    reports = {r: (out / f"rank{r}.txt").read_text() for r in range(WORLD) if (out / f"rank{r}.txt").exists()}
    return codes, reports, logs


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("hang", [False, True], ids=["dead-peer", "stuck-peer"])
def test_every_survivor_reports_and_exits(tmp_path: Path, hang: bool, transport: str) -> None:
    if hang and transport == "torch" and not FAULTS:
        pytest.skip(IN_FAULTS)
    codes, reports, _ = run_ranks(tmp_path, hang, transport=transport)
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert all(codes[r] == 1 for r in survivors), f"exit codes {codes}; reports {reports}"
    if not hang:
        assert codes[VICTIM] == 17, codes
    assert sorted(reports) == survivors, reports
    for r in survivors:
        text = reports[r]
        assert text.startswith("PipelineError: "), text
        # the failure that stands names the peer that died; for a stalled one, whichever rank's deadline passed
        # first posts, and the chain back to the victim is in the ranks' own lines (rank 2's, checked below)
        cause = text.splitlines()[0].removeprefix("PipelineError: ")
        if hang:
            assert re.search(r"waited \d+\.\d s for .* from rank \d; is another rank stuck or dead\?", cause), text
        elif transport == "torch":  # gloo: closed/reset by peer; the rank that stopped stamping is named first
            assert re.match(rf"global ranks? {VICTIM}\b.* stopped or died", cause), text
            assert f"from rank {VICTIM} failed: " in cause and "peer" in cause, text
        else:  # shm: a survivor saw the victim's process gone, and names it first
            assert re.match(rf"rank {VICTIM} died \(pid \d+\): rank \d waited for .* from rank {VICTIM}$", cause), text
        assert text.endswith(f"on {TRANSPORTS[transport]})"), text
        # this rank's own place in its planned action list
        mine = text.splitlines()[1]
        assert re.match(rf"rank {r} at {r}[A-Z_]+\d* \(action \d+ of \d+; last completed: .*\), waiting for ", mine), (
            text
        )
        assert "planned: " in mine and f">>{r}" in mine, text
    # rank 2 receives stage 1's output from the victim, which dies in its forward of micro-batch 2; the outputs of
    # micro-batches 0 and 1 it sent just before may die with it in flight (gloo's send returns once queued), so
    # rank 2 may be left waiting for any of the three
    assert re.search(rf"waiting for stage 1's output for micro-batch [0-2] from rank {VICTIM}\b", reports[2]), reports[
        2
    ]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_failure_in_one_replica_stops_the_other_pipelines(tmp_path: Path, transport: str) -> None:
    """pp 2 x dp 2: rank 3 raises in its forward and stays alive. Ranks 0 and 2, the other pipeline, meet it only
    in the data-parallel all-reduce: they read its error on the mesh's board, well before their deadline."""
    if transport == "torch" and not FAULTS:
        pytest.skip(IN_FAULTS)
    codes, reports, _ = run_ranks(tmp_path, hang=False, mesh=True, victim=3, transport=transport)
    assert "ValueError: the tripwire fired" in reports.get(3, ""), reports
    for r in (0, 1, 2):
        text = reports.get(r, "")
        assert codes[r] == 1 and text.startswith("PipelineError: "), f"rank {r}: exit {codes[r]}: {text}"
        blamed = "pipeline rank 1 (global rank 3: pp=1 dp=1 sharding=0 tp=0) at 1F2: ValueError: the tripwire fired"
        assert blamed in text, text
        assert "waited" not in text.splitlines()[0], text  # the board stopped them, not a deadline


@pytest.mark.parametrize("joined", ["pipeline-store", "reused-run-id"])
def test_a_clean_job_on_a_store_that_outlived_a_failed_one_trains(tmp_path: Path, joined: str) -> None:
    """A failed job leaves its failure (and its process group's keys) in the store; the next job on the same store
    must not read them. ``pipeline-store``: a new process group prefix, the same ``Pipeline(store=...)``.
    ``reused-run-id``: both jobs join as torchrun's workers with an agent store do, with the same run id and
    attempt (``--rdzv-id`` reused on a store that outlives its jobs): the scope's nonce keeps them apart - the
    second job neither hangs in init nor reads the first one's error. Its losses match the one-process model's."""
    if joined == "reused-run-id" and not FAULTS:
        pytest.skip(IN_FAULTS)
    store = host_store()
    failed, clean = tmp_path / "failed", tmp_path / "clean"
    failed.mkdir()
    clean.mkdir()
    extra = ("--run-id", "reused") if joined == "reused-run-id" else ()
    codes, reports, _ = run_ranks(failed, hang=False, store=store, job="first", extra=extra)
    assert codes[VICTIM] == 17 and all(codes[r] == 1 for r in range(WORLD) if r != VICTIM), (codes, reports)
    codes, reports, logs = run_ranks(clean, hang=False, victim=-1, store=store, job="second", extra=extra)
    assert all(codes[r] == 0 for r in range(WORLD)), (codes, reports, logs)
    # the reference: the same two steps in one process (plain SGD is not used: no optimizer, so the loss repeats)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * fc.M, fc.D, dtype=torch.float64, generator=g)
    y = torch.randint(0, fc.CLASSES, (4 * fc.M,), generator=g)
    want = F.cross_entropy(sw.build_model(fc.layers(WORLD))(x), y).item()
    for r in range(WORLD):
        words = reports[r].split()
        assert words[0] == "ok", reports[r]
        for got in map(float, words[1:]):
            assert abs(got - want) < 1e-9 * max(1.0, abs(want)), (r, got, want)


def test_when_every_rank_fails_at_once_none_waits_for_the_others(tmp_path: Path) -> None:
    """Every rank raises the same CheckpointError (a checkpoint that is not there), uncaught, with a pipeline
    timeout of 600 s: no rank waits for another to read its failure - each has failed itself - so all leave
    with exit code 1 within the guard (start-up and three 5 s timeouts), where the old exit path held each one
    for the whole timeout + 3 s."""
    codes, _, logs = run_ranks(tmp_path, hang=False, victim=-1, extra=("--refused",))
    assert all(codes[r] == 1 for r in range(WORLD)), (codes, logs)
    for r in range(WORLD):
        assert "CheckpointError: no checkpoint at" in logs[r], logs[r][-2000:]
        assert "terminate called" not in logs[r] and "Fatal Python error" not in logs[r], logs[r][-2000:]


@pytest.mark.skipif(not os.environ.get("STAGEWISE_FAULTS"), reason="a 4-rank job of its own: `make faults`")
def test_a_process_killed_during_a_relayout(tmp_path: Path) -> None:
    """Rank 1 posts its re-layout transfers and dies (os._exit: no error posted anywhere). Every survivor raises a
    PipelineError naming it within the deadline (no hang) and still holds the layout and the state from before the
    call (parameters, Adam's state and step, steps trained: to the bit). That state stays resumable: a new job
    loading the checkpoint saved just before the call trains on with the losses the job had from it (each rank
    trained two steps from that checkpoint before the call, then loaded it back)."""
    failed, resumed = tmp_path / "failed", tmp_path / "resumed"
    failed.mkdir()
    resumed.mkdir()
    slow = STARTUP + 30.0  # (a guard, not a bound: each job also saves, trains and loads a checkpoint)
    codes, reports, _ = run_ranks(failed, hang=False, extra=("--relayout",), startup=slow)
    survivors = [r for r in range(WORLD) if r != VICTIM]
    assert codes[VICTIM] == 17, codes
    for r in survivors:
        text = reports.get(r, "")
        assert codes[r] == 1 and text.startswith("PipelineError: "), f"rank {r}: exit {codes[r]}: {text}"
        assert re.search(rf"\brank {VICTIM}\b", text.splitlines()[0]), text
        assert "(state unchanged: True)" in text, text
        assert text.endswith("the layout from before kept: True)"), text
    extra = ("--relayout", "--resume", str(failed / "before"))
    codes, reports, logs = run_ranks(resumed, hang=False, victim=-1, extra=extra, startup=slow)
    assert all(codes[r] == 0 for r in range(WORLD)), (codes, reports, logs)
    for r in range(WORLD):
        want = (failed / f"rank{r}-reference.txt").read_text().split()
        assert reports[r].split() == ["ok", *want], (r, reports[r], want)


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_rank_0_failing_in_the_watch_it_leads_stops_every_rank(tmp_path: Path, how: str) -> None:
    """Rank 0 leads a Replanner's watch (the others sent their step's events and wait for its word) and fails in it:
    raising, it tells the others why and every one raises a PipelineError that names rank 0 and the error; killed
    (os._exit: nothing told), every other rank raises a PipelineError naming rank 0 within the deadline."""
    if how == "dies" and not FAULTS:
        pytest.skip(IN_FAULTS)
    codes, reports, logs = run_ranks(tmp_path, hang=False, victim=0, extra=("--watch", how))
    if how == "dies":
        assert codes[0] == 17, codes
    else:
        assert codes[0] == 3 and "RuntimeError: the watch broke" in reports.get(0, ""), (codes, reports, logs)
    for r in range(1, WORLD):
        text = reports.get(r, "")
        assert codes[r] == 1 and text.startswith("PipelineError: "), f"rank {r}: exit {codes[r]}: {text}"
        first = text.splitlines()[0]
        if how == "raises":
            assert "rank 0 failed while watching the run" in first and "the watch broke" in first, text
        else:
            assert re.search(r"\branks? 0\b", first), text
