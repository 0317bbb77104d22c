"""The checks the multi-process runtime tests run: each runs on every rank of one process group.

A check raises (AssertionError or anything else) to fail. ``checks(world)``
is a pure function of the world size and the schedule registry, so the pytest
side can list the same names without starting processes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import stagewise as sw
from helpers import models as mdl
from helpers.compare import ATOL, RTOL, assert_grads_close, assert_params_close
from stagewise.ir import Action, Kind, Schedule, loop_placement, v_placement
from stagewise.passes import lower, split_backward
from stagewise.runtime.comm import groups
from transport_checks import transport_checks
from worker import Check, Ctx, gather_objects, raises

TIMEOUT = 30.0


# ---- schedules written here, as Schedule objects -------------------------------
def v_gpipe(p: int, m: int, split: bool) -> Schedule:
    """All forwards, then all backwards, on V placement (2 stages per rank); optionally split into I/W."""
    placement = v_placement(p, 2)
    ranks = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        acts = [Action(first, Kind.F, i) for i in range(m)] + [Action(second, Kind.F, i) for i in range(m)]
        acts += [Action(second, Kind.B, i) for i in range(m)] + [Action(first, Kind.B, i) for i in range(m)]
        ranks.append(acts)
    s = Schedule("v-gpipe", m, placement, tuple(tuple(a) for a in ranks))
    return lower(split_backward(s) if split else s)


def looped(p: int, m: int) -> Schedule:
    """Breadth-first over 2 loop-placed virtual stages per rank (stage s on rank s % p)."""
    placement = loop_placement(p, 2)
    ranks = []
    for r in range(p):
        acts = [Action(r + c * p, Kind.F, i) for c in (0, 1) for i in range(m)]
        acts += [Action(r + c * p, Kind.B, i) for c in (1, 0) for i in range(m)]
        ranks.append(acts)
    return lower(Schedule("looped", m, placement, tuple(tuple(a) for a in ranks)))


def one_f_one_b_split(p: int, m: int) -> Schedule:
    return lower(split_backward(sw.schedules.generate("1f1b", p, m)), grad_sync=True)


# ---- parity ------------------------------------------------------------------
def parity(
    model: str,
    schedule: str | Callable[[int], Schedule],
    m: int,
    *,
    v: int | None = None,
    partition: Any = "uniform",
    dtype: torch.dtype = torch.float64,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> Check:
    """Two train steps; after each, loss and every local gradient equal the one-process model's."""

    def check(ctx: Ctx) -> None:
        sched = schedule if isinstance(schedule, str) else schedule(ctx.world)
        if model == "mlp":
            layers, loss_fn, data = mdl.mlp(dtype=dtype), F.cross_entropy, lambda b, seed: mdl.mlp_data(b, seed, dtype)
        else:
            layers, loss_fn, data = mdl.lm(dtype=dtype), mdl.lm_loss, mdl.lm_data
        pipe = sw.Pipeline(
            layers,
            loss_fn=loss_fn,
            schedule=sched,
            microbatches=None if isinstance(sched, Schedule) else m,
            virtual_stages=v,
            partition=partition,
            group=ctx.group,
            seed=7,
            timeout=TIMEOUT,
        )
        ref = sw.build_model(layers, seed=7)
        batch = 2 * m + 1  # uneven micro-batches
        for step in range(2):
            x, y = data(batch, seed=100 + step)
            loss = pipe.train_step(x, y)
            ref.zero_grad(set_to_none=True)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) <= 10 * atol + rtol * abs(ref_loss.item()), (loss, ref_loss.item())
            assert_grads_close(pipe, ref, f"step {step}", rtol=rtol, atol=atol)
            pipe.zero_grad(set_to_none=True)

    return check


def _vs(info: Any) -> tuple[int, ...]:
    return info.virtual_stages if info.virtual_stages is not None else (1, 2)


def _supported(name: str, p: int, m: int, v: int) -> bool:
    """Combinations the registry refuses (with a clear ValueError, tested with the schedules) are skipped."""
    try:
        sw.build_schedule(name, p, m, v)
    except ValueError:
        return False
    return True


def parity_checks(world: int) -> dict[str, Check]:
    """Every registered schedule (and a few written here) x models x micro-batch counts."""
    p = world
    out: dict[str, Check] = {}
    for name in sw.schedule_names(synchronous=True):
        info = sw.schedule_info(name)
        for v in _vs(info):
            counts = [m for m in sorted({1, p - 1, 2 * p + 1}) if m >= 1 and _supported(name, p, m, v)]
            if not counts:
                continue
            tag = f"{name}-v{v}"
            for m in counts:
                out[f"parity-mlp-{tag}-m{m}"] = parity("mlp", name, m, v=v)
            stages = p * v
            uneven = [10 - (stages - 1)] + [1] * (stages - 1)
            out[f"parity-mlp-{tag}-m{counts[-1]}-uneven"] = parity("mlp", name, counts[-1], v=v, partition=uneven)
            out[f"parity-lm-{tag}-m{counts[0]}"] = parity("lm", name, counts[0], v=v)
    for m in sorted({1, p + 1}):
        out[f"parity-mlp-1f1b-split-m{m}"] = parity("mlp", lambda w, m=m: one_f_one_b_split(w, m), m)
        out[f"parity-lm-v-gpipe-split-m{m}"] = parity("lm", lambda w, m=m: v_gpipe(w, m, True), m)
        out[f"parity-mlp-looped-m{m}"] = parity("mlp", lambda w, m=m: looped(w, m), m)
    out["parity-mlp-v-gpipe-m2-parameters"] = parity("mlp", lambda w: v_gpipe(w, 2, False), 2, partition="parameters")
    out["parity-float32-mlp-1f1b"] = parity("mlp", "1f1b", p + 1, dtype=torch.float32, rtol=1e-5, atol=1e-6)
    return out


# ---- features ------------------------------------------------------------------
def structured_values(schedule: str, partition: list[int] | str) -> Check:
    """Dict inputs with a non-tensor and a dim-1 tensor; tuples (with int tensors, a str, a float) and dicts
    between stages."""

    def check(ctx: Ctx) -> None:
        layers = mdl.structured()
        pipe = sw.Pipeline(
            layers,
            loss_fn=F.cross_entropy,
            schedule=schedule,
            microbatches=3,
            partition=partition,
            batch_dim=mdl.STRUCTURED_BATCH_DIM,
            group=ctx.group,
            timeout=TIMEOUT,
        )
        ref = sw.build_model(layers)
        for step in range(2):
            x, y = mdl.structured_data(7, seed=step)
            loss = pipe.train_step(x, y)
            ref.zero_grad(set_to_none=True)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) < 1e-10
            assert_grads_close(pipe, ref, f"step {step}")
            pipe.zero_grad()
        out = pipe.eval_step(x)
        if pipe.rank == pipe.schedule.placement[-1]:
            torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
        else:
            assert out is None

    return check


def eval_step(ctx: Ctx) -> None:
    """Forward only: outputs on the last stage's rank, merged over micro-batches; no autograd graph."""
    layers = mdl.lm()
    pipe = sw.Pipeline(layers, loss_fn=mdl.lm_loss, schedule="1f1b", microbatches=3, group=ctx.group, timeout=TIMEOUT)
    ref = sw.build_model(layers)
    x, y = mdl.lm_data(5, seed=3)
    pipe.train_step(x, y)  # train and eval shapes are learned separately
    for batch in (5, 5):
        x, _ = mdl.lm_data(batch, seed=4)
        out = pipe.eval_step(x)
        if pipe.rank == pipe.schedule.placement[-1]:
            assert not out.requires_grad
            torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
            parts = pipe.eval_step(x, merge_outputs=False)
            assert [t.shape[0] for t in parts] == [2, 2, 1]
        else:
            assert out is None
            assert pipe.eval_step(x, merge_outputs=False) is None


def shape_mismatch(ctx: Ctx) -> None:
    """A later step with another batch size: every rank raises a PipelineError naming stage and shapes."""
    pipe = sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, group=ctx.group, timeout=TIMEOUT
    )
    pipe.train_step(*mdl.mlp_data(8, seed=0))
    try:
        pipe.train_step(*mdl.mlp_data(6, seed=1))
    except sw.PipelineError as err:
        text = str(err)
        assert "stage 0" in text and "(3, 16)" in text and "(4, 16)" in text, text
        assert "another size (a DataLoader's short last batch? DataLoader(..., drop_last=True)" in text, text
        assert "variable_shapes=True" in text and "reset_shapes()" in text, text
    else:
        raise AssertionError("a batch of another size went through")
    try:
        pipe.train_step(*mdl.mlp_data(8, seed=0))
    except sw.PipelineError as err:
        assert "failed earlier" in str(err), str(err)
    else:
        raise AssertionError("a failed pipeline ran again")


def reset_shapes(ctx: Ctx) -> None:
    """reset_shapes() on every rank lets the next step use new shapes."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="gpipe", microbatches=2, group=ctx.group, timeout=TIMEOUT
    )
    ref = sw.build_model(layers)
    for batch in (8, 5):
        pipe.reset_shapes()
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, y = mdl.mlp_data(batch, seed=batch)
        pipe.train_step(x, y)
        F.cross_entropy(ref(x), y).backward()
        assert_grads_close(pipe, ref, f"batch {batch}")


def short_last_batch(ctx: Ctx) -> None:
    """A data loader's epoch ends on a short batch: with variable_shapes=True, plain tensors (not pre-cut
    MicroBatches) of 8, 8, then 5 rows train as one process does, and the next epoch's 8 again."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, group=ctx.group, timeout=TIMEOUT,
        variable_shapes=True,
    )  # fmt: skip
    ref = sw.build_model(layers)
    for step, batch in enumerate((8, 8, 5, 8)):
        pipe.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x, y = mdl.mlp_data(batch, seed=step)
        loss = pipe.train_step(x, y)
        expected = F.cross_entropy(ref(x), y)
        expected.backward()
        assert abs(loss - float(expected)) <= 1e-12 * abs(float(expected)), (step, loss, float(expected))
        assert_grads_close(pipe, ref, f"step {step}, batch {batch}")


def ranks_given_unlike_batches(ctx: Ctx) -> None:
    """Each rank fed its own samples (a DistributedSampler over every process): named on the first train step, in
    a warning on rank 0; the step trains what each rank reads (rank 0's inputs, the last rank's targets), as
    before; later steps, and None where a rank reads nothing, say nothing."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, group=ctx.group, timeout=TIMEOUT
    )
    mine = [mdl.mlp_data(8, seed=10 + r) for r in range(ctx.world)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = pipe.train_step(*mine[ctx.rank])
        x, y = mdl.mlp_data(8, seed=3)
        first, last = ctx.rank == 0, ctx.rank == ctx.world - 1
        again = pipe.train_step(x if first else None, y if last else None)
    said = [str(w.message) for w in caught if "were given different" in str(w.message)]
    assert len(said) == (1 if ctx.rank == 0 else 0), said
    if said:
        assert said[0].startswith("pipeline ranks 0 and 1 were given different inputs on the first train step")
    ref = sw.build_model(layers)
    want = F.cross_entropy(ref(mine[0][0]), mine[-1][1]).item()  # what was trained: rank 0's x, the last's y
    assert abs(loss - want) <= 1e-10 * max(1.0, abs(want)), (loss, want)
    assert math.isfinite(again)


def failure_propagates(ctx: Ctx) -> None:
    """A layer raising on the last rank: it raises its own error, every other rank a PipelineError."""
    layers = mdl.mlp(num_layers=6)[:-1] + [sw.Layer(mdl.Boom), mdl.mlp()[-1]]
    pipe = sw.Pipeline(
        layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, group=ctx.group, timeout=TIMEOUT
    )
    x, y = mdl.mlp_data(8, seed=0)
    pipe.train_step(x, y)
    mdl.Boom.armed = True
    try:
        pipe.train_step(x, y)
    except sw.PipelineError as err:
        assert pipe.rank != ctx.world - 1, "the failing rank should raise its own error"
        assert f"rank {ctx.world - 1}" in str(err) and "Boom" in str(err), str(err)
    except RuntimeError as err:
        assert pipe.rank == ctx.world - 1 and "Boom" in str(err), str(err)
    else:
        raise AssertionError("no error")
    finally:
        mdl.Boom.armed = False


def invalid_arguments(ctx: Ctx) -> None:
    """Clear ValueErrors, on every rank, before anything can hang."""
    p = ctx.world

    stages = 2 * p
    raises(
        ValueError,
        f"{stages} stages need at least {stages} layers, got {stages - 1}",
        lambda: sw.Pipeline(mdl.mlp(num_layers=stages - 1), schedule="zb-v", group=ctx.group),
    )
    raises(
        ValueError,
        f"has {p + 1} ranks, but the process group has {p}",
        lambda: sw.Pipeline(mdl.mlp(), schedule=sw.build_schedule("gpipe", p + 1, 2), group=ctx.group),
    )
    raises(
        ValueError,
        f"sums to {7 + p} layers, but the model has 10",
        lambda: sw.Pipeline(mdl.mlp(), partition=[8] + [1] * (p - 1), group=ctx.group),
    )
    raises(ValueError, f"has {p + 1} entries", lambda: sw.Pipeline(mdl.mlp(), partition=[1] * (p + 1), group=ctx.group))
    raises(ValueError, "unknown schedule", lambda: sw.Pipeline(mdl.mlp(), schedule="no-such", group=ctx.group))
    window = sw.schedules.async_schedule("pipedream", p, 2, 2)  # (its micro-batches are a window's)
    raises(
        ValueError,
        "microbatches=1, but schedule 'pipedream' runs 4 in a window of 2 mini-batches of 2: a Schedule fixes",
        lambda: sw.Pipeline(mdl.mlp(), schedule=window, microbatches=1, group=ctx.group),
    )
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, microbatches=4, group=ctx.group, timeout=TIMEOUT)
    raises(ValueError, "4 micro-batches need at least 4 samples", lambda: pipe.train_step(*mdl.mlp_data(3, seed=0)))


def timeline(ctx: Ctx) -> None:
    """Every executed action is recorded once; gather=True collects all ranks on one clock."""
    pipe = sw.Pipeline(
        mdl.mlp(), loss_fn=F.cross_entropy, schedule="zb-h1", microbatches=4, group=ctx.group, timeout=TIMEOUT
    )
    pipe.train_step(*mdl.mlp_data(8, seed=0))
    local = pipe.timeline()
    assert local.source == "measured" and local.unit == "s"
    assert [e.action for e in local.events] == list(pipe.schedule.ranks[pipe.rank])
    assert all(e.rank == pipe.rank and 0 <= e.start <= e.end for e in local.events)
    everyone = pipe.timeline(gather=True)
    assert everyone.num_ranks == ctx.world
    for r in range(ctx.world):
        assert [e.action for e in everyone.by_rank()[r]] == list(pipe.schedule.ranks[r])
    assert min(e.start for e in everyone.events) == 0.0


def optimizer_factory(ctx: Ctx) -> None:
    """optimizer= steps each stage at its STEP action: parameters equal one SGD step of the reference."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(
        layers,
        loss_fn=F.cross_entropy,
        schedule="zb-h2",
        microbatches=4,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        group=ctx.group,
        timeout=TIMEOUT,
    )
    ref = sw.build_model(layers)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = mdl.mlp_data(9, seed=step)
        pipe.train_step(x, y)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    assert_params_close(pipe, ref, "after two steps")
    assert all(p.grad is None for p in pipe.parameters()), "STEP zeroes the gradients"


def state_dict_names(ctx: Ctx) -> None:
    """state_dict keys are the one-process model's, split between ranks without overlap."""
    layers = mdl.lm()
    pipe = sw.Pipeline(layers, schedule="zb-v", group=ctx.group, timeout=TIMEOUT)
    keys = list(pipe.state_dict())
    everyone = gather_objects(keys, ctx.group)
    flat = [k for ks in everyone for k in ks]
    assert sorted(flat) == sorted(sw.build_model(layers).state_dict()), flat
    ref = sw.build_model(layers, seed=0).state_dict()
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def grouped_transport(ctx: Ctx) -> None:
    """The NCCL code path (schedule batches via batch_isend_irecv, first exchanges on a gloo side group),
    exercised on gloo."""
    groups.GROUPED_BACKENDS.add("gloo")
    try:
        for name in ("1f1b", "dualpipe-v"):
            parity("mlp", name, 3)(ctx)
    finally:
        groups.GROUPED_BACKENDS.discard("gloo")


def subgroups(ctx: Ctx) -> None:
    """Pipelines on groups {0, 2} and {1, 3}: group ranks differ from global ranks, WORLD is not the group."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[ctx.rank % 2]
    sub = Ctx(rank=dist.get_rank(mine), world=2, group=mine)
    parity("mlp", "zb-h1", 3)(sub)
    parity("lm", "dualpipe-v", 2)(sub)


def _mlp_pipeline(**options: Any) -> Any:
    return sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, timeout=60, **options)


def different_options(ctx: Ctx) -> str:
    """Rank 2 asks for 2 micro-batches, the others for 4: every rank refuses with the same message, naming the
    option and who holds which value (it used to wait for the deadline and blame a peer)."""
    words = ["ranks were built with different options", "microbatches: ranks 0, 1, 3 have 4; rank 2 has 2"]
    message = raises(ValueError, words, lambda: _mlp_pipeline(microbatches=2 if ctx.rank == 2 else 4))
    assert len(set(gather_objects(message, None))) == 1, "the ranks raised different errors"
    return message


def different_layout(ctx: Ctx) -> str:
    """Rank 3 asks for pp=4, the others for pp=2 x dp=2: refused before any group of either layout is made."""
    import torch.distributed.distributed_c10d as c10d

    made = len(c10d._world.pg_map)
    config = sw.ParallelConfig(pp=4) if ctx.rank == 3 else sw.ParallelConfig(pp=2, dp=2)
    message = raises(
        ValueError, ["parallel: ranks 0, 1, 2 have", "dp=2", "rank 3 has"], lambda: _mlp_pipeline(parallel=config)
    )
    assert len(c10d._world.pg_map) == made, "process groups were made before the options were compared"
    return message


def different_weights(ctx: Ctx) -> str:
    """``from_model`` on each rank's own copy of the model: built unseeded, the copies differ, and the pipeline
    trained a mix no rank's model held without a word (2026-12-06); now rank 0 warns, naming parameters. Seeded
    alike: nothing said."""
    import warnings

    from torch import nn

    def built(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(4, 4, dtype=torch.float64) for _ in range(4)])

    said = []
    for seed in (ctx.rank, 7):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sw.Pipeline.from_model(built(seed), loss_fn=F.mse_loss, timeout=60)
        said.append([str(w.message) for w in caught if "holds other weights" in str(w.message)])
    assert said[1] == [], said  # alike: nothing to say
    assert len(said[0]) == (1 if ctx.rank == 0 else 0), said
    if ctx.rank == 0:
        assert "(0.weight, 0.bias, 1.weight and 5 more)" in said[0][0], said[0][0]
    return said[0][0] if said[0] else ""


def alike_per_group(ctx: Ctx) -> None:
    """Two pipelines on groups {0, 2} and {1, 3} may differ from each other (the check is per pipeline group):
    each trains like one process."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[ctx.rank % 2]
    sub = Ctx(rank=dist.get_rank(mine), world=2, group=mine)
    parity("mlp", "1f1b" if ctx.rank % 2 == 0 else "gpipe", 2 + ctx.rank % 2)(sub)


def feature_checks(world: int) -> dict[str, Check]:
    """Two ranks; the structured model's stage boundaries are placed by hand."""
    assert world == 2, "the feature checks are written for 2 ranks"
    return {
        "structured-1f1b": structured_values("1f1b", [2, 3]),
        "structured-zb-v": structured_values("zb-v", [1, 1, 1, 2]),
        "eval-step": eval_step,
        "timeline": timeline,
        "optimizer-factory": optimizer_factory,
        "state-dict-names": state_dict_names,
        "reset-shapes": reset_shapes,
        "short-last-batch-variable-shapes": short_last_batch,
        "ranks-given-unlike-batches": ranks_given_unlike_batches,
        "invalid-arguments": invalid_arguments,
        "grouped-transport": grouped_transport,
        # last: these leave abandoned receives behind (on their own tags)
        "failure-propagates": failure_propagates,
        "shape-mismatch": shape_mismatch,
    }


SUITES: dict[str, Callable[[int], dict[str, Check]]] = {
    "parity": parity_checks,
    "features": feature_checks,
    "subgroups": lambda world: {"subgroups": subgroups},
    "agreement": lambda world: {
        "different-options": different_options,
        "different-layout": different_layout,
        "alike-per-group": alike_per_group,
        "different-weights": different_weights,
    },
    "transport": transport_checks,
}


def checks(world: int, suite: str) -> dict[str, Check]:
    """The checks of ``suite``: suite names joined by '+', e.g. ``parity+features``."""
    out: dict[str, Check] = {}
    for part in suite.split("+"):
        if part not in SUITES:
            raise ValueError(f"unknown suite {part!r}; known: {', '.join(SUITES)}")
        out.update(SUITES[part](world))
    return out
