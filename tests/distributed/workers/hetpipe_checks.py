"""HetPipe (wave-synchronous parallel over virtual workers) on 4 gloo ranks, against the one-process replay.

    torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks hetpipe_checks --out DIR

Parity checks train a float64 MLP and compare every loss, every wave's global
loss and every final parameter with ``wsp_reference`` to 1e-12, for D in
{0, 1, 2} on 2 VWs x pp2 and on VWs of different stage counts (pp3 + pp1, pp2 + pp1 + pp1); the
pp3 + pp1 run emulates a 2.5x slower rank 3 (``emulate_slowdown``), whose sleeps are counted, not timed. D = 0
with one plain-SGD mini-batch per wave is compared with synchronous data
parallelism computed in one process (the full batch's mean gradient). The
mutants: D = 1 run against a D = 0 replay must differ by far; a HetPipe that
pulls one wave too early must be stopped by the run-time staleness check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import stagewise as sw
from helpers import models as mdl
from oracles.wsp_reference import wsp_reference
from stagewise.asynchronous import StalenessError
from stagewise.runtime.engine import interpreter
from worker import Check, Ctx, refused

TOL = 1e-12

__all__ = ["checks"]


def optimizer(kind: str) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        if kind == "momentum":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01)

    return make


def global_batches(count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [mdl.mlp_data(batch, seed=200 + k) for k in range(count)]


def run(ctx: Ctx, workers: Sequence[Sequence[int]], data: list[Any], **kw: Any) -> tuple[sw.HetPipe, list[float]]:
    het = sw.HetPipe(mdl.mlp(), loss_fn=F.cross_entropy, virtual_workers=workers, seed=3, timeout=60.0, **kw)
    losses = list(het.train_stream(het.local_batch(x, y) for x, y in data))
    return het, losses


def reference(workers: Sequence[Sequence[int]], data: list[Any], **kw: Any) -> Any:
    k = len(workers)
    streams = [[(x.tensor_split(k)[v], y.tensor_split(k)[v]) for x, y in data] for v in range(k)]
    stages = [len(w) for w in workers]
    return wsp_reference(mdl.mlp(), streams, stages=stages, loss_fn=F.cross_entropy, seed=3, **kw)


def compare(het: sw.HetPipe, losses: list[float], ref: Any) -> float:
    """The largest difference in this VW's losses, the global wave losses and this rank's final parameters."""
    mine = ref.losses[het.vw]
    assert len(losses) == len(mine), (len(losses), len(mine))
    worst = max(abs(a - b) for a, b in zip(losses, mine))
    assert len(het.stats.global_losses) == len(ref.global_losses)
    worst = max(worst, max(abs(a - b) for a, b in zip(het.stats.global_losses, ref.global_losses)))
    params = dict(ref.model.named_parameters())
    for name, q in het.named_parameters():
        worst = max(worst, (q.detach() - params[name].detach()).abs().max().item())
    return worst


class _Sleeps:
    """Stands in for the interpreter's ``time`` module: records the emulation's sleeps (no wall-clock judged)."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.perf_counter = time.perf_counter
        self.thread_time, self.process_time = time.thread_time, time.process_time  # the compute's CPU clocks

    def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)
        time.sleep(seconds)


def parity(
    workers: list[list[int]], staleness: int, opt: str, schedule: str, wave: int, waves: int,
    slow: list[float] | None = None, default_wave: bool = False,
) -> Check:  # fmt: skip
    """``default_wave``: HetPipe given no ``wave=`` (the replay ``wave``: the deepest VW's stage count)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        data = global_batches(wave * waves - 1, 12)  # a shorter last wave
        kw = {"staleness": staleness, "schedule": schedule, "wave": wave}
        sleeps, real = _Sleeps(), interpreter.time
        interpreter.time = sleeps  # type: ignore[assignment]
        given = {**kw, "wave": None} if default_wave else kw
        try:
            het, losses = run(ctx, workers, data, optimizer=optimizer(opt), emulate_slowdown=slow, **given)
        finally:
            interpreter.time = real
        factor = 1.0 if slow is None else slow[ctx.rank]
        computes = 2 * len(data)  # one F and one B per mini-batch and stage, one stage per rank
        assert len(sleeps.calls) == (computes if factor > 1 else 0), (factor, len(sleeps.calls))
        assert all(t > 0 for t in sleeps.calls)
        ref = reference(workers, data, optimizer=optimizer(opt), counts=het.stage_counts, **kw)
        worst = compare(het, losses, ref)
        assert worst <= TOL, f"differs from the replay by {worst:.3e}"
        assert max(abs(a - losses[0]) for a in losses) > 1e-3, "the losses did not move"
        assert het.stats.waves == waves and max(het.stats.leads) <= staleness, het.stats
        assert het.stats.max_lead == min(staleness, waves - 1), het.stats  # it did run ahead as far as allowed
        return {"worst": worst, "leads": het.stats.leads}

    return check


def partitioned_by_speed(ctx: Ctx) -> dict[str, Any]:
    """Each VW is cut for its own ranks: VW 0's rank 1 at half speed gets fewer layers than VW 1's; D = 1."""
    data = global_batches(5, 12)
    kw = {"staleness": 1, "schedule": "pipedream", "wave": 2, "optimizer": optimizer("sgd")}
    het, losses = run(
        ctx, [[0, 1], [2, 3]], data, partition="parameters", speeds=[1.0, 0.25, 1.0, 1.0], **kw
    )  # fmt: skip
    counts = het.stage_counts
    assert counts[0] != counts[1] and counts[0][1] < counts[1][1], counts
    worst = compare(het, losses, reference([[0, 1], [2, 3]], data, counts=counts, **kw))
    assert worst <= TOL, f"differs from the replay by {worst:.3e}"
    return {"worst": worst, "counts": counts}


def d0_is_data_parallel(ctx: Ctx) -> dict[str, Any]:
    """D = 0, one synchronous plain-SGD mini-batch per wave: synchronous data parallelism over 2 pipelines, i.e.
    one process stepping on each global batch's mean gradient."""
    data = global_batches(4, 8)
    het, _ = run(ctx, [[0, 1], [2, 3]], data, optimizer=optimizer("sgd"), staleness=0, schedule="1f1b", wave=1)
    model = sw.build_model(mdl.mlp(), seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    worst = max(abs(a - b) for a, b in zip(het.stats.global_losses, expected))
    params = dict(model.named_parameters())
    for name, q in het.named_parameters():
        worst = max(worst, (q.detach() - params[name].detach()).abs().max().item())
    assert worst <= TOL, f"D=0 differs from synchronous data parallelism by {worst:.3e}"
    return {"worst": worst}


def mutant_reference(ctx: Ctx) -> dict[str, Any]:
    """Run D = 1, replay D = 0: the parity must fail by far (so the parity checks can see a wrong rule)."""
    data = global_batches(6, 8)
    kw = {"schedule": "pipedream", "wave": 2, "optimizer": optimizer("sgd")}
    het, losses = run(ctx, [[0, 1], [2, 3]], data, staleness=1, **kw)
    worst = compare(het, losses, reference([[0, 1], [2, 3]], data, staleness=0, counts=het.stage_counts, **kw))
    assert worst > 1e4 * TOL, f"D=1 and a D=0 replay agree to {worst:.3e}"
    return {"worst": worst}


def mutant_early_pull(ctx: Ctx) -> dict[str, Any]:
    """A HetPipe that pulls one wave too early runs D + 1 waves ahead: the run-time check stops it, on every rank."""
    try:  # (a rank still building its HetPipe may meet the relayed error there: seen at load 9 on 2 cores)
        het = sw.HetPipe(
            mdl.mlp(), loss_fn=F.cross_entropy, virtual_workers=[[0, 1], [2, 3]], staleness=1, schedule="pipedream",
            wave=2, optimizer=optimizer("sgd"), seed=3, timeout=60.0,
        )  # fmt: skip
        het._pull_lag = 1
        list(het.train_stream(het.local_batch(x, y) for x, y in global_batches(8, 8)))
    except (StalenessError, sw.PipelineError) as err:  # the first VW to see it relays it to the rest (one board)
        assert "2 waves ahead of the slowest VW, but the staleness bound is D=1" in str(err), str(err)
        return {"error": type(err).__name__}
    raise AssertionError("no StalenessError")


def _tied(ctx: Ctx) -> Any:
    layers = [
        sw.Tied("emb", sw.Layer(torch.nn.Embedding, 10, mdl.D, dtype=torch.float64)),
        sw.Layer(torch.nn.Linear, mdl.D, mdl.D, dtype=torch.float64),
        sw.Tied("emb", forward_fn=lambda emb, h: h @ emb.weight.T),
    ]
    return sw.HetPipe(
        layers, loss_fn=F.cross_entropy, virtual_workers=[[0, 1], [2, 3]], schedule="1f1b",
        optimizer=optimizer("sgd"), timeout=60.0,
    )  # fmt: skip


def _bad_layout(ctx: Ctx) -> Any:
    return sw.HetPipe(
        mdl.mlp(), loss_fn=F.cross_entropy, virtual_workers=[[0, 1], [2]], optimizer=optimizer("sgd"), timeout=60.0
    )


def _auto(ctx: Ctx) -> Any:
    """(It was refused as an "unknown schedule 'auto'", though every VW's Pipeline takes it.)"""
    return sw.HetPipe(
        mdl.mlp(), loss_fn=F.cross_entropy, virtual_workers=[[0, 1], [2, 3]], schedule="auto",
        optimizer=optimizer("sgd"), timeout=60.0,
    )  # fmt: skip


def checks(world: int) -> dict[str, Check]:
    assert world == 4, "hetpipe_checks runs on 4 ranks"
    pp2 = [[0, 1], [2, 3]]
    return {
        "parity-d0-pipedream-2x2": parity(pp2, 0, "adam", "pipedream", wave=2, waves=3),
        "parity-d1-pipedream-2x2": parity(pp2, 1, "momentum", "pipedream", wave=2, waves=4),
        "parity-d1-1f1b-2x2": parity(pp2, 1, "sgd", "1f1b", wave=2, waves=3),
        "parity-d1-pp3-pp1": parity([[0, 1, 2], [3]], 1, "sgd", "pipedream", wave=3, waves=3, slow=[1, 1, 1, 2.5]),
        "parity-d2-pp2-pp1-pp1": parity([[0, 1], [2], [3]], 2, "adam", "pipedream-2bw", wave=2, waves=4),
        # the default wave on VWs of 3 and 1 stages: 3 mini-batches each (a wave of its own depth each made VW 1
        # run 3 waves to VW 0's 1 on equal streams, refused mid-stream as streams "of different lengths")
        "parity-default-wave-pp3-pp1": parity([[0, 1, 2], [3]], 1, "sgd", "pipedream", 3, 3, default_wave=True),
        "partitioned-by-speed": partitioned_by_speed,
        "d0-is-data-parallel": d0_is_data_parallel,
        "mutant-d1-replayed-as-d0": mutant_reference,
        "refuse-tied": refused(_tied, "HetPipe does not take tied modules (sw.Tied keys ['emb'])"),
        "refuse-layout": refused(_bad_layout, "ranks [3] of the world (4 ranks) are in no VW"),
        "refuse-auto": refused(_auto, "HetPipe: schedule must be a registered name (each VW builds it for its own"),
        "mutant-early-pull": mutant_early_pull,  # last: it leaves a failed board behind
    }
