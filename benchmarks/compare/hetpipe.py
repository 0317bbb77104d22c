"""HetPipe's rows in the seeds' comparison: 2 virtual workers of one rank each, the second EMULATED 2x slower.

Each VW trains the workload's model as a one-stage pipeline (``1f1b``, the
comparison's micro-batches) on its own half of the comparison's mini-batches
(VW 0 the even ones, VW 1 the odd ones: the same samples as every other row),
in waves of ``WAVE`` mini-batches, with staleness bound D = 0 (the
synchronous reference: a barrier per wave) and D = 1. Rank 1 sleeps as long as
it computes (``emulate_slowdown``): an emulation of a device half as fast,
which the other rows do not have - their samples/s are not comparable to
these, their losses are. The simulated columns are those of the same layout
at p = 4 (2 VWs x pp2, 1F1B each, the two VWs side by side, wave syncs free).
D = 0 is data parallelism over the VWs (each update the mean of two mini-batches'),
not one-process training, so it is not part of the verdicts' synchronous reference.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.passes import lower

from .methods import Method, RunContext

WAVE = 4
SLOWDOWN = 2.0


def _train(method: Method, ctx: RunContext, seed: int) -> dict[str, Any]:
    """One HetPipe row (a collective on 2 ranks); every rank returns the same record."""
    args, wl = ctx.args, ctx.workload
    if ctx.world_size != 2:
        raise ValueError(f"the hetpipe rows run 2 virtual workers of one rank, got {ctx.world_size} ranks")
    batches = wl.train(args.steps, args.batch, seed)
    batches = batches[: len(batches) // 2 * 2]  # the VWs' streams are equally long (an odd last batch is dropped)
    wave = min(WAVE, len(batches) // 2)
    staleness = 0 if method.family == "sync" else 1
    het = sw.HetPipe(
        wl.layers(), loss_fn=wl.loss_fn, virtual_workers=[[0], [1]], staleness=staleness, schedule="1f1b",
        microbatches=args.microbatches, wave=wave, seed=seed, emulate_slowdown=[1.0, SLOWDOWN],
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
    )  # fmt: skip
    mine = batches[ctx.rank :: 2]
    dist.barrier()
    t0 = time.perf_counter()
    ends = []
    for k, _ in enumerate(het.train_stream(mine), start=1):
        if k % wave == 0 or k == len(mine):
            ends.append(time.perf_counter() - t0)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    wave_ends = torch.tensor(ends, dtype=torch.float64)
    dist.all_reduce(wave_ends, op=dist.ReduceOp.MAX)  # when the last VW finished each wave
    per_wave = 2 * wave * args.batch  # samples both VWs train in a wave
    curve = [
        (min((k + 1) * per_wave, len(batches) * args.batch), float(t), float(loss))
        for k, (t, loss) in enumerate(zip(wave_ends.tolist(), het.stats.global_losses, strict=False))
    ]
    results: dict[str, Any] = {}
    pipe = het.pipe  # every VW holds the global model after the stream
    for split, (x, y) in wl.eval_sets(args.microbatches).items():
        pipe.reset_shapes()
        logits = pipe.eval_step(x)
        results[f"{split}_loss"] = float(wl.loss_fn(logits, y))
        results[f"{split}_accuracy"] = wl.accuracy(logits, y)
    weights = sum(p.numel() * p.element_size() for p in pipe.parameters())
    memory = {"weights": [weights] * 2, "versions": [0] * 2, "activations": [0] * 2}
    memory["activations_source"] = "not measured (HetPipe)"
    return {
        "seed": seed,
        "samples_per_s": len(batches) * args.batch / elapsed.item(),
        "curve": curve,
        "memory": memory,
        "timeline": None,
        "max_lead": het.stats.max_lead,
        **results,
    }


def _pairs(values: tuple[float, ...], last: bool = False) -> tuple[float, ...]:
    """The 4 profiled stages as 2: stages 0+1 and 2+3 (or, ``last``, the second of each pair's value)."""
    return tuple(values[k + 1] if last else values[k] + values[k + 1] for k in (0, 2))


def _simulate(method: Method, ctx: RunContext) -> dict[str, Any]:
    """2 VWs x pp2 at p = 4: each VW a 2-stage 1F1B on half the samples, side by side (wave syncs free)."""
    c = sw.CostModel.from_dict(ctx.profiled["costs"])
    costs = sw.CostModel(
        2, _pairs(c.forward), _pairs(c.backward_input), _pairs(c.backward_weight), _pairs(c.activation_bytes),
        _pairs(c.weight_activation_bytes), _pairs(c.parameter_bytes), _pairs(c.output_bytes, last=True),
    )  # fmt: skip
    m = ctx.args.microbatches
    result = sw.simulate(lower(sw.build_schedule("1f1b", 2, m)), costs)
    per_rank = list(costs.parameter_bytes) * 2  # VW 0 on ranks 0-1, VW 1 on ranks 2-3
    return {
        "bubble": result.bubble_ratio,
        "throughput": 2 * m * (ctx.args.batch / m) / result.makespan,
        "versions": [1] * 4,
        "activations": list(result.peak_activations) * 2,
        "memory": {"weights": per_rank, "versions": [0.0] * 4, "activations": list(result.peak_activation_bytes) * 2},
        "timeline": None,
    }


COMPARE_METHODS = [
    Method("hetpipe-wsp D=0 (2 VWs, one 2x slower)", "sync", lambda p, m, n: sw.build_schedule("1f1b", 1, m),
           run=_train, simulate=_simulate, reference=False),
    Method("hetpipe-wsp D=1 (2 VWs, one 2x slower)", "async", lambda p, m, n: sw.build_schedule("1f1b", 1, m),
           run=_train, simulate=_simulate, reference=False),
]  # fmt: skip
