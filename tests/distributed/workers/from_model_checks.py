"""Checks for ``Pipeline.from_model`` and profile-based partitions, run on every rank of one torchrun job.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks from_model_checks \
        --out DIR [--only a,b]

Each check raises to fail and may return a dict of figures, written with its
result (one JSON line per check and rank). ``checks(world)`` is a pure
function of the world size, so pytest lists the same names without starting
processes. The models are in ``helpers.nets``.
"""

from __future__ import annotations

import copy
import functools
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import ATOL, RTOL, assert_grads_close, assert_params_close
from helpers.nets import (
    CLASSES,
    NARROW,
    VOCAB,
    Dense,
    HiddenTieNet,
    SkipNet,
    TiedNet,
    Unbalanced,
    skip_data,
    token_loss,
)  # fmt: skip
from stagewise.partition.cut import partition_costs
from worker import Check, Ctx, gather_objects, raises

TIMEOUT = 60.0


# ---- helpers --------------------------------------------------------------------------
def _everyone(obj: Any, ctx: Ctx) -> list[Any]:
    return gather_objects(obj, ctx.group)


# ---- parity -----------------------------------------------------------------------------
def parity(tags: str | None, schedule: str, stages: int, m: int, partition: str | None = None) -> Check:
    """Two train steps and an eval step of SkipNet against an untouched deep copy of it, in one process."""

    def check(ctx: Ctx) -> dict[str, Any]:
        num_blocks = stages if tags else stages + 2
        model = SkipNet(num_blocks, stages, tags, seed=3)
        ref = copy.deepcopy(model)
        (x, scale), y = skip_data(2 * m + 1, seed=0)
        options: dict[str, Any] = {}
        if tags is None:
            options = {"stages": stages, "partition": partition}
            if partition in ("time", "memory"):
                options["sample_inputs"] = (x[:2], scale[:2])
        pipe = sw.Pipeline.from_model(
            model,
            loss_fn=F.cross_entropy,
            schedule=schedule,
            microbatches=m,
            group=ctx.group,
            timeout=TIMEOUT,
            **options,
        )
        assert pipe.schedule.num_stages == stages, pipe.schedule.num_stages
        for step in range(2):
            (x, scale), y = skip_data(2 * m + 1, seed=step)  # uneven micro-batches: n differs between them
            loss = pipe.train_step((x, scale), y)
            ref.zero_grad(set_to_none=True)
            ref_loss = F.cross_entropy(ref(x, scale), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) <= 1e-10 * (1 + abs(ref_loss.item())), (loss, ref_loss.item())
            assert_grads_close(pipe, ref, f"step {step}")
            pipe.zero_grad(set_to_none=True)
        out = pipe.eval_step((x, scale))
        if pipe.rank == pipe.schedule.placement[-1]:
            torch.testing.assert_close(out, ref(x, scale), rtol=RTOL, atol=ATOL)
        # original names; this rank's share only; the rest of the model freed
        mine = sorted(n for n, _ in pipe.named_parameters())
        assert mine == sorted(n for n, p in model.named_parameters() if not p.is_meta), mine
        keys = [k for ks in _everyone(list(pipe.state_dict()), ctx) for k in ks]
        assert sorted(keys) == sorted(ref.state_dict()), keys
        names = [n for ns in _everyone(mine, ctx) for n in ns]
        assert sorted(names) == sorted(n for n, _ in ref.named_parameters()), names
        crossing = pipe.model_cut.stage_inputs
        if stages > 2 and partition != "time":  # the residual and the int are passed through the middle stages
            # (a profiled cut depends on measured times, so which values cross it is only checked for fixed cuts)
            assert all("relu" in c and "size" in c for c in crossing[1:]), crossing
        return {"blocks per stage": [len(r) for r in pipe.layer_ranges], "stage inputs": [list(c) for c in crossing]}

    return check


# ---- tied parameters across stages ------------------------------------------------------
def tied_model(schedule: str, stages: int, m: int, functional: bool) -> Check:
    """Two SGD steps with clipping against an untouched copy: loss, every gradient, the clipped norm counting the
    tied weight once, the parameters after the steps (the copies stay equal); every state-dict key saved once."""

    def check(ctx: Ctx) -> dict[str, Any]:
        model = TiedNet(stages + 1, functional)
        ref = copy.deepcopy(model)
        pipe = sw.Pipeline.from_model(
            model, stages=stages, loss_fn=token_loss, schedule=schedule, microbatches=m, group=ctx.group,
            timeout=TIMEOUT,
        )  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=0.3)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            ids, y = torch.randint(0, VOCAB, (2 * m + 1, 5), generator=g), torch.randint(0, VOCAB, (2 * m + 1, 5))
            loss = pipe.train_step(ids, y)
            ref_loss = token_loss(ref(ids), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) <= 1e-10 * (1 + abs(ref_loss.item())), (loss, ref_loss.item())
            norm = pipe.clip_grad_norm_(0.05)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
            assert abs(norm - ref_norm) <= 1e-10 * ref_norm, (norm, ref_norm)
            assert_grads_close(pipe, ref, f"step {step}", aliases=True)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        assert_params_close(pipe, ref, "after two steps", aliases=True)
        keys = [k for ks in _everyone(list(pipe.state_dict()), ctx) for k in ks]
        assert sorted(keys) == sorted(ref.state_dict()), keys  # each key once, over all ranks
        pipe.load_state_dict(pipe.state_dict())  # a key saved elsewhere is not asked for
        owners = sorted({pipe.schedule.placement[0], pipe.schedule.placement[-1]})
        return {"owners": owners, "groups": len(pipe.tied.groups)}

    return check


def hidden_tie(ctx: Ctx) -> None:
    """A head block reading ``embed.weight`` through ``self.__dict__`` (a tie from_model cannot see), embed and
    head on two ranks: the first step fails at the head's first forward naming the parameter, its owner and its
    user (rank 1), and every other rank says so; whether the rank freed its copy or kept one no rank would sum
    (``free_unused=False``: before, training drifted from the model's silently)."""
    said = "'head' (stage 1) uses the parameter 'embed.weight' of 'embed' (stage 0), which this rank does not hold"
    kind = sw.runtime.SplitError if ctx.rank == 1 else sw.PipelineError
    for free, state in ((True, "has freed it"), (False, "holds a copy whose gradient no rank would sum")):
        raises(kind, [said, state], functools.partial(_hidden_tie_step, ctx, free))


def _hidden_tie_step(ctx: Ctx, free_unused: bool) -> None:
    pipe = sw.Pipeline.from_model(
        HiddenTieNet(2), stages=2, partition=[2, 2], loss_fn=token_loss, schedule="1f1b", microbatches=2,
        free_unused=free_unused, group=ctx.group, timeout=TIMEOUT,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (4, 3), generator=torch.Generator().manual_seed(0))
    pipe.train_step(ids, ids)


# ---- layer lists: speeds, memory caps, failures ------------------------------------------
def equal_layers(n: int = 12, d: int = 128) -> list[sw.Layer]:
    return [sw.Layer(Dense, d, d) for _ in range(n - 1)] + [sw.Layer(nn.Linear, d, CLASSES)]


def layers_time_speeds(ctx: Ctx) -> dict[str, Any]:
    """Equal layers, ranks at speeds 1 and 0.5. ``partition="time"``: the cut is the exact min-max cut of the
    measured profile divided by the speeds (the times are measured, so only that relation is asserted, never a
    ratio of them: a loaded machine times equal layers unequally); ``"balanced"`` (counted on meta, the same on
    every machine): the slow rank holds about half a fast rank's layers. Gradients exact in both."""
    layers = equal_layers()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, CLASSES, (64,), generator=torch.Generator().manual_seed(1))
    speeds = [1.0] * (ctx.world - 1) + [0.5]
    shown: dict[str, Any] = {}
    for how in ("time", "balanced"):
        pipe = sw.Pipeline(
            layers,
            loss_fn=F.cross_entropy,
            schedule="1f1b",
            microbatches=4,
            partition=how,
            sample_inputs=x[:16],
            speeds=speeds,
            group=ctx.group,
            seed=4,
            timeout=TIMEOUT,
        )
        counts = [len(r) for r in pipe.layer_ranges]
        assert _everyone(counts, ctx) == [counts] * ctx.world, f"ranks disagree on the {how} partition"
        if how == "time":
            want = partition_costs(pipe.layer_profile.times(), ctx.world, speeds=speeds).counts
            assert counts == want, (counts, want)
        else:  # 11 equal layers and a small head: the slow stage's share of the equal ones about half a fast one's
            dense = counts[:-1] + [counts[-1] - 1]
            fast = statistics.mean(dense[:-1])
            assert 0.3 <= dense[-1] / fast <= 0.75, counts
        ref = sw.build_model(layers, seed=4)
        pipe.train_step(x, y)
        F.cross_entropy(ref(x), y).backward()
        assert_grads_close(pipe, ref, f"speeds, {how}", rtol=1e-5, atol=1e-6)
        shown[how] = counts
    return {"layers per stage": shown}


def layers_memory_caps(ctx: Ctx) -> dict[str, Any]:
    """partition="memory" evens out bytes; a cap on one rank moves layers off it; an impossible cap raises
    the same ValueError on every rank."""
    widths = [64, 64, 256, 256, 64, 64, 64, 64]
    layers = [sw.Layer(Dense, a, b) for a, b in zip(widths, widths[1:])] + [sw.Layer(nn.Linear, 64, CLASSES)]
    x = torch.randn(8, 64)

    def build(**kw: Any) -> sw.Pipeline:
        return sw.Pipeline(
            layers, schedule="gpipe", microbatches=2, sample_inputs=x[:4], group=ctx.group, timeout=TIMEOUT, **kw
        )

    balanced = build(partition="memory")
    from stagewise.partition import layer_memory

    memory = layer_memory(balanced.layer_profile, in_flight=2)
    held = [sum(memory[i] for i in r) for r in balanced.layer_ranges]
    cap = min(held) * 1.05
    caps = [max(held) * 10] * (ctx.world - 1) + [cap]  # the last rank may hold little
    capped = build(partition="time", memory_caps=caps)
    last = sum(memory[i] for i in capped.layer_ranges[-1])
    assert last <= cap, (last, cap)
    message = raises(
        ValueError, "fits the memory caps", lambda: build(partition="memory", memory_caps=[1000.0] * ctx.world)
    )
    return {"bytes per stage (memory)": [int(b) for b in held], "error": message[:160]}


def profile_failure(ctx: Ctx) -> None:
    """The first rank fails while profiling (wrong sample width): it raises its own error, the others say so."""
    bad = torch.randn(4, 7)
    if ctx.rank == 0:
        raises(RuntimeError, "shapes cannot be multiplied", lambda: _time_pipe(ctx, bad))
    else:
        raises(RuntimeError, "rank 0 of the pipeline group failed while profiling", lambda: _time_pipe(ctx, bad))


def _time_pipe(ctx: Ctx, sample: torch.Tensor) -> sw.Pipeline:
    return sw.Pipeline(equal_layers(4, 8), partition="time", sample_inputs=sample, group=ctx.group, timeout=TIMEOUT)


def from_stages(ctx: Ctx) -> None:
    """``Pipeline.from_stages`` at 2 ranks (the splitting guide's block): each rank passes the stage it built; the
    loss and its stage's gradients are the one-process model's (float64)."""
    torch.manual_seed(0)
    stages = {0: nn.Sequential(nn.Linear(8, 32), nn.ReLU()).double(), 1: nn.Linear(32, 3).double()}
    ref = nn.ModuleDict({f"stage{s}": copy.deepcopy(m) for s, m in stages.items()})
    pipe = sw.Pipeline.from_stages(
        {ctx.rank: stages[ctx.rank]}, loss_fn=F.cross_entropy, microbatches=2, group=ctx.group, timeout=TIMEOUT
    )
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.arange(16) % 3
    loss = pipe.train_step(x, y)
    want = F.cross_entropy(ref["stage1"](ref["stage0"](x)), y)
    want.backward()
    assert abs(loss - want.item()) <= RTOL * max(1.0, abs(want.item())), (loss, want.item())
    assert assert_grads_close(pipe, ref, "from_stages") == len(list(stages[ctx.rank].parameters()))


def refusals(ctx: Ctx) -> None:
    """Clear errors on every rank, before anything could hang."""
    p = ctx.world
    raises(
        ValueError,
        f"the model's tags name {p + 1} stages, which do not divide evenly over {p} ranks",
        lambda: sw.Pipeline.from_model(SkipNet(p + 1, p + 1, "attr"), group=ctx.group),
    )
    raises(
        ValueError,
        "which schedule '1f1b' cannot run",
        lambda: sw.Pipeline.from_model(SkipNet(2 * p, 2 * p, "attr"), schedule="1f1b", group=ctx.group),
    )
    raises(
        sw.runtime.SplitError,
        "so partition= does not apply",
        lambda: sw.Pipeline.from_model(SkipNet(p, p, "attr"), partition="time", group=ctx.group),
    )
    raises(
        ValueError,
        "pass sample_inputs=",
        lambda: sw.Pipeline.from_model(SkipNet(p + 2), stages=p, partition="time", group=ctx.group),
    )
    raises(
        ValueError,
        f"speeds has 1 entries, expected one per rank ({p})",
        lambda: sw.Pipeline(equal_layers(4, 8), partition="parameters", speeds=[1.0], group=ctx.group),
    )
    raises(
        ValueError,
        "partition='uniform' does not",
        lambda: sw.Pipeline(equal_layers(4, 8), partition="uniform", speeds=[1.0] * p, group=ctx.group),
    )


# ---- balance, from the profile -------------------------------------------------------------
def balance(ctx: Ctx) -> dict[str, Any]:
    """Unbalanced (layer widths 32 and 384) with partition="time": the cut is the exact min-max cut of the
    profile's costs (deterministic given the profile, unlike measured step times, which live in benchmarks/),
    and it is better balanced on those costs than the uniform cut."""
    from stagewise.partition import partition_costs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, NARROW, generator=g)
    pipe = sw.Pipeline.from_model(
        Unbalanced(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, partition="time",
        sample_inputs=x, group=ctx.group, timeout=TIMEOUT,
    )  # fmt: skip
    prof = pipe.layer_profile
    assert prof is not None
    costs = prof.times()
    counts = [len(r) for r in pipe.layer_ranges]
    best = partition_costs(costs, ctx.world)
    assert counts == list(best.counts), (counts, best.counts)
    uniform = [len(costs) // ctx.world + (k < len(costs) % ctx.world) for k in range(ctx.world)]

    def worst(cs: list[int]) -> float:
        bounds = [sum(cs[:k]) for k in range(len(cs) + 1)]
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

    assert worst(counts) < worst(uniform), (counts, uniform, costs)
    return {"blocks per stage": counts, "uniform": uniform}


# ---- the default cut, decided on one rank --------------------------------------------------
def default_cut(ctx: Ctx) -> dict[str, Any]:
    """``partition`` left at its default ("balanced") under zb-v: rank 0 counts the layers on the meta device
    and cuts; every other rank takes rank 0's cut without computing one (its own ``decide`` is replaced by
    one that fails); the cut balances the ranks where the even cut gives one of them twice the blocks; it is
    what the checkpoint's layout records; and the gradients are the one-process model's."""
    from stagewise.runtime.checkpoint.state import layout_of
    from stagewise.runtime.frontends import default_cut as decided_here
    from stagewise.runtime.frontends.layers import named_layers

    layers = [sw.Layer(Dense, 8, 128)] + [sw.Layer(Dense, 128, 128) for _ in range(6)] + [sw.Layer(nn.Linear, 128, 4)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    decide = decided_here.decide
    if ctx.rank != 0:
        decided_here.decide = _refuse_to_decide  # type: ignore[assignment]
    try:
        pipe = sw.Pipeline(
            layers, loss_fn=F.cross_entropy, schedule="zb-v", microbatches=4, sample_inputs=x[:8],
            group=ctx.group, seed=3, timeout=TIMEOUT,
        )  # fmt: skip
    finally:
        decided_here.decide = decide
    counts = [len(r) for r in pipe.layer_ranges]
    assert _everyone(counts, ctx) == [counts] * ctx.world, "ranks disagree on the cut"
    mine = decide(named_layers(layers), pipe.schedule, sample_inputs=x[:8], speeds=None, seed=3, device="cpu")
    assert counts == mine.counts and mine.source == "counted", (counts, mine)
    blocks = [
        sum(1 for s in pipe.schedule.stages_of(r) for k in pipe.layer_ranges[s] if 1 <= k <= 6)
        for r in range(ctx.world)
    ]
    assert max(blocks) - min(blocks) <= 1, (counts, blocks)
    assert layout_of(pipe, ctx.world)["pipeline"]["layers"] == [[r.start, r.stop] for r in pipe.layer_ranges]
    ref = sw.build_model(layers, seed=3)
    pipe.train_step(x, y)
    F.cross_entropy(ref(x), y).backward()
    assert_grads_close(pipe, ref, "default cut", rtol=1e-5, atol=1e-6)
    first = _cut_at_first_batch(ctx)
    return {"layers per stage": counts, "blocks per rank": blocks, "at the first batch": first, **_from_model(ctx)}


def _from_model(ctx: Ctx) -> dict[str, Any]:
    """``from_model`` with the default partition goes through the same decision: rank 0 counts the top-level
    blocks on ``sample_inputs`` (the others never decide), every rank takes its cut, which is the counted
    cut (not the uniform one: the wide blocks cost ~8 narrow ones), and the layout records it."""
    from stagewise.runtime.checkpoint.state import layout_of
    from stagewise.runtime.frontends import default_cut as decided_here
    from stagewise.runtime.measure.profiling import model_blocks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, NARROW, generator=g)
    decide = decided_here.decide
    if ctx.rank != 0:
        decided_here.decide = _refuse_to_decide  # type: ignore[assignment]
    try:
        pipe = sw.Pipeline.from_model(
            Unbalanced(), loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, sample_inputs=x[:4],
            group=ctx.group, timeout=TIMEOUT,
        )  # fmt: skip
    finally:
        decided_here.decide = decide
    counts = [len(r) for r in pipe.layer_ranges]
    blocks = list(model_blocks(Unbalanced()))
    mine = decide(blocks, pipe.schedule, sample_inputs=x[:4], speeds=None, seed=0, device="cpu")
    uniform = [len(blocks) // ctx.world + (k < len(blocks) % ctx.world) for k in range(ctx.world)]
    assert counts == mine.counts != uniform and mine.source == "counted", (counts, mine.counts, uniform)
    assert _everyone(counts, ctx) == [counts] * ctx.world, "ranks disagree on the cut"
    recorded = layout_of(pipe, ctx.world)["pipeline"]
    assert recorded["partition"] == "balanced" and [b - a for a, b in recorded["layers"]] == counts, recorded
    return {"from_model blocks per stage": counts}


class _Conv(nn.Module):
    def __init__(self, a: int, b: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(a, b, 3, stride=stride, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class _PoolHead(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def _cut_at_first_batch(ctx: Ctx) -> list[int]:
    """Convolutions without sample inputs: built evenly, then at the first train step rank 0 times each layer
    on the first micro-batch and every rank moves to the time cut of the profile it was handed (the others
    never decide nor time; every rank holds the same profile) before the step; the cut is recorded as the
    run's own, and the step's gradients are the one-process model's (the timings themselves vary: no cut is
    asserted but the profile's)."""
    from stagewise.runtime.checkpoint.state import layout_of
    from stagewise.runtime.frontends import default_cut as decided_here

    convs = [(1, 16, 1), (16, 16, 1), (16, 16, 2), (16, 16, 2), (16, 16, 1)]
    layers = [sw.Layer(_Conv, a, b, s) for a, b, s in convs] + [sw.Layer(_PoolHead, 16, 4)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 32, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, group=ctx.group, seed=3)
    assert [len(r) for r in pipe.layer_ranges] == [3, 3], pipe.layer_ranges  # a convolution: even until an input
    decide, timed, unplain = decided_here.decide, decided_here.timed_profile, decided_here.unplain
    handed: list[Any] = []

    def taken(data: dict[str, Any]) -> Any:  # what this rank was handed, kept
        handed.append(unplain(data))
        return handed[-1]

    decided_here.unplain = taken  # type: ignore[assignment]
    if ctx.rank != 0:
        decided_here.decide = _refuse_to_decide  # type: ignore[assignment]
        decided_here.timed_profile = _refuse_to_decide  # type: ignore[assignment]
    try:
        pipe.train_step(x, y)
    finally:
        decided_here.decide, decided_here.timed_profile, decided_here.unplain = decide, timed, unplain
    counts = [len(r) for r in pipe.layer_ranges]
    (got,) = handed
    assert got.source == "timed" and got.profile is not None and len(got.profile.layers) == len(layers), got
    assert counts == got.counts == decided_here.cut_by(got.profile, pipe.schedule), (counts, got)
    assert _everyone([counts, got.profile.to_json()], ctx) == [[counts, got.profile.to_json()]] * ctx.world
    assert layout_of(pipe, ctx.world)["pipeline"]["partition"] == "re-planned"
    ref = sw.build_model(layers, seed=3)
    F.cross_entropy(ref(x), y).backward()
    assert_grads_close(pipe, ref, "cut at the first batch", rtol=1e-5, atol=1e-6)
    held = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=4, group=ctx.group, seed=3)
    mine_only = torch.optim.SGD(held.parameters(), lr=0.1) if ctx.rank == 1 else None  # the README's pattern, one rank
    held.train_step(x, y)
    assert _everyone([len(r) for r in held.layer_ranges], ctx) == [[3, 3]] * ctx.world, "an optimizer's cut moved"
    if mine_only is not None:
        mine_only.step()  # its parameters are still the pipeline's: no re-layout refused it
    return counts


def resumed_cut(ctx: Ctx) -> dict[str, Any]:
    """A resume keeps the recorded cut: saved from the default ("balanced") cut, resumed into a pipeline whose
    rank 0 decides another (as a changed torch's counting or a profile measured again would): the pipeline is
    re-laid out to the recorded cut, its state the saved state exactly, and the next step's loss the one the
    saving pipeline takes; counts given by the user are kept."""
    import tempfile
    from pathlib import Path

    from stagewise.runtime.frontends import default_cut as decided_here

    layers = [sw.Layer(Dense, 8, 64)] + [sw.Layer(Dense, 64, 64) for _ in range(4)] + [sw.Layer(nn.Linear, 64, 4)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    options: dict[str, Any] = {"loss_fn": F.cross_entropy, "schedule": "1f1b", "microbatches": 4, "seed": 3}
    options.update(sample_inputs=x[:4], group=ctx.group, timeout=TIMEOUT, optimizer=lambda p: torch.optim.Adam(p))
    pipe = sw.Pipeline(layers, **options)
    recorded = [len(r) for r in pipe.layer_ranges]
    for _ in range(2):
        pipe.train_step(x, y)
    root = Path(gather_objects(tempfile.mkdtemp(prefix="cut") if ctx.rank == 0 else None, ctx.group)[0])
    sw.checkpoint.save(root, pipe, step=2)
    other = [recorded[0] + 1, recorded[1] - 1] if recorded[1] > 1 else [recorded[0] - 1, recorded[1] + 1]
    decide = decided_here.decide
    decided_here.decide = lambda *a, **k: decided_here.DefaultCut(list(other), None, "parameters")  # type: ignore
    try:
        again = sw.Pipeline(layers, **options)
    finally:
        decided_here.decide = decide
    assert [len(r) for r in again.layer_ranges] == other != recorded, (other, recorded)
    info = sw.checkpoint.resume(root, again)
    assert info is not None and info.step == 2 and info.layout["pipeline"]["partition"] == "balanced", info
    assert [len(r) for r in again.layer_ranges] == recorded, ([len(r) for r in again.layer_ranges], recorded)
    mine, theirs = again.state_dict(), pipe.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert again.train_step(x, y) == pipe.train_step(x, y)  # the optimizer's state came along exactly
    second = _resumed_twice(again, layers, options, other, ctx, decided_here)
    given = sw.Pipeline(layers, **{**options, "partition": list(other)})
    sw.checkpoint.resume(root, given)
    assert [len(r) for r in given.layer_ranges] == other  # counts the user gave are the user's
    more = Path(gather_objects(tempfile.mkdtemp(prefix="cut") if ctx.rank == 0 else None, ctx.group)[0])
    replanned = _resumed_after_a_replan(pipe, layers, options, other, x, y, more)
    snapshot = _resumed_from_a_snapshot(layers, options, other, x, y, more, decided_here)
    return {"recorded": recorded, "decided again": other, "re-planned": replanned, "snapshot": snapshot,
            "a second restart": second}  # fmt: skip


def _resumed_twice(resumed: Any, layers: Any, options: Any, other: list[int], ctx: Ctx, here: Any) -> Any:
    """A pipeline that took the recorded cut back records it as the run's own (re-planned), so a second restart
    whose build decides another takes it back too (recorded as counts given, it would keep its own)."""
    import tempfile
    from pathlib import Path

    cut = [len(r) for r in resumed.layer_ranges]
    root = Path(gather_objects(tempfile.mkdtemp(prefix="cut") if ctx.rank == 0 else None, ctx.group)[0])
    sw.checkpoint.save(root, resumed, step=3)
    decide = here.decide
    here.decide = lambda *a, **k: here.DefaultCut(list(other), None, "parameters")
    try:
        third = sw.Pipeline(layers, **options)
    finally:
        here.decide = decide
    info = sw.checkpoint.resume(root, third)
    assert info is not None and info.layout["pipeline"]["partition"] == "re-planned", info
    assert [len(r) for r in third.layer_ranges] == cut != other, ([len(r) for r in third.layer_ranges], cut)
    mine, theirs = third.state_dict(), resumed.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return cut


def _resumed_after_a_replan(pipe: Any, layers: Any, options: Any, cut: list[int], x: Any, y: Any, root: Any) -> Any:
    """A live re-plan (the Replanner's own apply) moves the cut; saved; a restart built with "balanced" resumes
    on the re-planned cut (recorded as "re-planned"), not on its own decision."""
    from stagewise.runtime import Replanner

    Replanner(pipe, steps=10)._apply({"schedule": "1f1b", "counts": list(cut)})
    pipe.train_step(x, y)
    folder = root / "replanned"
    sw.checkpoint.save(folder, pipe, step=3)
    again = sw.Pipeline(layers, **options)
    assert [len(r) for r in again.layer_ranges] != cut
    info = sw.checkpoint.resume(folder, again)
    assert info is not None and info.layout["pipeline"]["partition"] == "re-planned", info
    assert [len(r) for r in again.layer_ranges] == cut, ([len(r) for r in again.layer_ranges], cut)
    assert again.train_step(x, y) == pipe.train_step(x, y)
    return cut


def _resumed_from_a_snapshot(layers: Any, options: Any, other: list[int], x: Any, y: Any, root: Any, here: Any) -> Any:
    """The same from the peers' snapshots (the code path resume shares): the recorded cut taken back."""
    snap = {**options, "snapshot": sw.Snapshots(every=2, folder=str(root / "snap"))}
    a = sw.Pipeline(layers, **snap)
    recorded = [len(r) for r in a.layer_ranges]
    for _ in range(2):
        a.train_step(x, y)
    a.snapshots.wait()
    decide = here.decide
    here.decide = lambda *args, **k: here.DefaultCut(list(other), None, "parameters")
    try:
        b = sw.Pipeline(layers, **{**options, "snapshot": sw.Snapshots(every=2, folder=str(root / "snap"))})
    finally:
        here.decide = decide
    info = sw.checkpoint.resume(root / "snap" / "ckpt", b)
    assert info is not None and info.step == 2 and "peer snapshots" in info.reason, info
    assert [len(r) for r in b.layer_ranges] == recorded != other, ([len(r) for r in b.layer_ranges], recorded)
    assert b.train_step(x, y) == a.train_step(x, y)
    return recorded


def _refuse_to_decide(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a rank other than 0 computed the default cut")


# ---- the suites ------------------------------------------------------------------------------
def checks(world: int) -> dict[str, Check]:
    p = world
    out: dict[str, Check] = {
        f"tagged-1f1b-s{p}": parity("attr", "1f1b", p, m=p + 1),
        f"with-stage-zb-h1-s{p}": parity("with", "zb-h1", p, m=p),
        f"tagged-zb-v-s{2 * p}": parity("attr", "zb-v", 2 * p, m=p),
        f"with-stage-dualpipe-v-s{2 * p}": parity("with", "dualpipe-v", 2 * p, m=2 * p),
        f"untagged-time-1f1b-s{p}": parity(None, "1f1b", p, m=p + 1, partition="time"),
        f"untagged-time-zb-v-s{2 * p}": parity(None, "zb-v", 2 * p, m=p, partition="time"),
        f"untagged-parameters-gpipe-s{p}": parity(None, "gpipe", p, m=2, partition="parameters"),
        f"tied-1f1b-s{p}": tied_model("1f1b", p, m=p + 1, functional=False),
        f"tied-functional-zb-h1-s{p}": tied_model("zb-h1", p, m=p, functional=True),
        f"tied-zb-v-s{2 * p}": tied_model("zb-v", 2 * p, m=p, functional=False),
        f"tied-functional-interleaved-1f1b-s{2 * p}": tied_model("interleaved-1f1b", 2 * p, m=p, functional=True),
        "layers-time-speeds": layers_time_speeds,
        "layers-memory-caps": layers_memory_caps,
        "refusals": refusals,
        "profile-failure": profile_failure,
    }
    if world == 2:
        out["balance"] = balance
        out["default-cut"] = default_cut
        out["resumed-cut"] = resumed_cut
        out["from-stages"] = from_stages
        out["hidden-tie"] = hidden_tie
    return out
