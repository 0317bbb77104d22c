"""The combination matrix on 4 gloo ranks: every way in x every option, exact or refused (``matrix_spec``).

torchrun --standalone --nproc-per-node 4 tests/distributed/workers/worker.py --checks matrix_checks --out DIR

An exact cell trains two SGD steps through the schedule's STEP actions (float64) and compares, on every rank,
the loss of each step and every parameter (and buffer) it holds with the one-process model trained alike;
for an asynchronous schedule and HetPipe the reference is the one-process replay of their rule. Each column
checks what its option does, besides: BatchNorm's running statistics, a NaN batch raised or skipped, autocast
in the lower precision, the measured activation bytes, a checkpoint loaded into a fresh pipeline. A refused
cell must raise on every rank, naming the combination, before any process group is made.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_params_close
from matrix_models import (
    BATCH,
    POISON,
    SEED,
    Built,
    build_row,
    hf_tp_plan,
    mlp_data,
    mlp_layers,
    mlp_tp_plan,
)
from matrix_spec import EXACT, cells, expected
from worker import Check, Ctx, gather_objects, raises

LR = 0.1
M = 4  # micro-batches of a synchronous step


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def column_options(row: str, column: str) -> dict[str, Any]:
    """The options a column asks for (the row's model decides the tensor-parallel plan)."""
    base: dict[str, Any] = {"optimizer": sgd, "microbatches": M}
    extra: dict[str, Any] = {
        "dp": {"parallel": sw.ParallelConfig(pp=2, dp=2)},
        "sharding": {"parallel": sw.ParallelConfig(pp=2, sharding=2)},
        "tp": {
            "parallel": sw.ParallelConfig(pp=2, tp=2),
            "tp_plan": hf_tp_plan() if row == "from_hf" else mlp_tp_plan(),
        },
        "recompute": {"recompute": "stage"},
        "bn_micro": {"batchnorm": "micro"},
        "bn_deferred": {"batchnorm": "deferred"},
        "nan_raise": {"nan_policy": "raise"},
        "nan_skip": {"nan_policy": "skip"},
        "autocast": {"autocast": torch.bfloat16},
        "async": {"schedule": "pipedream", "microbatches": 2},
        "measure_memory": {"measure_memory": True},
    }.get(column, {})
    return {**base, **extra}


def checks(world: int) -> dict[str, Check]:
    assert world == 4, "the matrix runs on 4 ranks"
    out = {f"{row}-{column}": cell(row, column) for row, column in cells()}
    out.update(PROTOCOL)
    return out


def cell(row: str, column: str) -> Check:
    def check(ctx: Ctx) -> dict[str, Any] | None:
        want = expected(row, column)
        if want != EXACT:
            groups = len(c10d._world.pg_map)
            raises(ValueError, want, lambda: build(row, column, ctx))
            assert len(c10d._world.pg_map) == groups, f"{row} x {column}: refused only after making process groups"
            return {"refused": want}
        if row == "hetpipe":
            from matrix_hetpipe import hetpipe_cell

            return hetpipe_cell(column, ctx)
        return COLUMNS.get(column, exact)(row, column, ctx)

    return check


def build(row: str, column: str, ctx: Ctx, *, shift: float = 0.0, **more: Any) -> Built:
    options = {**column_options(row, column), **more}
    if row == "hetpipe":
        from matrix_hetpipe import build_hetpipe

        return build_hetpipe(column, options)
    bn = column in ("bn_micro", "bn_deferred")
    dtype = torch.float32 if column == "autocast" else torch.float64
    parallel = options.get("parallel")
    replica = 0.0  # a model built by the user on every rank may differ between replicas: not the first's
    if parallel is not None and row in ("from_model", "from_hf", "from_stages"):
        c = parallel.coords(ctx.rank)
        replica = 0.01 * (c.dp + c.sharding + c.tp)
    return build_row(
        row, options, bn=bn, tied=column == "tied", ctx=ctx, dtype=dtype, shift=shift, replica_shift=replica
    )


# ---- the reference step ------------------------------------------------------------------------
def reference_step(b: Built, x: Any, y: Any, opt: torch.optim.Optimizer, micro: bool = False) -> float:
    """One step of the one-process model: the whole batch at once, or (``micro``: BatchNorm's cells) micro-batch
    by micro-batch, each loss weighted by its share, as the pipeline runs them."""
    assert b.ref is not None
    opt.zero_grad(set_to_none=True)
    if not micro:
        loss = b.loss_fn(b.ref(x), y)
        loss.backward()
        opt.step()
        return float(loss)
    total = 0.0
    for xk, yk in zip(x.tensor_split(M), y.tensor_split(M)):
        part = b.loss_fn(b.ref(xk), yk) * (len(yk) / len(y))
        part.backward()
        total += float(part)
    opt.step()
    return total


def ref_named(b: Built, pipe: Any) -> nn.Module:
    """The twin whose parameter names are the pipeline's (from_stages names its stages ``stage{s}``)."""
    assert b.ref is not None
    renamed = getattr(b.ref, "renamed", None)
    return b.ref if renamed is None else renamed(pipe.num_ranks)


def train_compare(b: Built, what: str, steps: int = 2, micro: bool = False, tol: float = 1e-10) -> list[float]:
    """Train ``steps`` steps on the pipeline and the twin; the losses and every parameter must agree."""
    pipe = b.pipe
    opt = torch.optim.SGD(b.ref.parameters(), lr=LR)  # type: ignore[union-attr]
    losses = []
    for step in range(steps):
        x, y = b.data(step)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        want = reference_step(b, x, y, opt, micro)
        assert abs(loss - want) <= tol * (1 + abs(want)), f"{what} step {step}: loss {loss} vs {want}"
        assert_params_close(pipe, ref_named(b, pipe), f"{what} after step {step}", aliases=True)
        losses.append(loss)
    assert abs(losses[-1] - losses[0]) > 1e-6, f"{what}: the loss did not move; the check would not see a bad update"
    return losses


def exact(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    b = build(row, column, ctx)
    return {"losses": train_compare(b, f"{row} x {column}")}


# ---- columns with more to check ------------------------------------------------------------------
def batchnorm(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Running statistics as the policy says: torch's update per micro-batch ("micro"), or once per step over
    the whole batch's moments, as one BatchNorm call on the micro-batches' inputs concatenated ("deferred")."""
    b = build(row, column, ctx)
    if b.ref is None or not any(isinstance(m, nn.BatchNorm1d) for m in b.ref.modules()):
        return {"losses": train_compare(b, f"{row} x {column} (no BatchNorm layer: a no-op)")}
    deferred = column == "bn_deferred"
    opt = torch.optim.SGD(b.ref.parameters(), lr=LR)
    for step in range(2):
        x, y = b.data(step)
        loss = b.pipe.train_step(*b.pipe.local_batch(x, y))
        with _deferred_statistics(b.ref) if deferred else _nothing():
            want = reference_step(b, x, y, opt, micro=True)
        assert abs(loss - want) <= 1e-10 * (1 + abs(want)), (step, loss, want)
        assert_params_close(b.pipe, ref_named(b, b.pipe), f"{row} x {column} step {step}", buffers=True)
    tracked = [int(t) for n, t in b.pipe.named_buffers() if n.endswith("num_batches_tracked")]
    assert all(t == (2 if deferred else 2 * M) for t in tracked), tracked
    return {"tracked": tracked}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _deferred_statistics:
    """The deferred policy's reference: the micro-batch forwards leave the running statistics alone; at the end
    one ``F.batch_norm`` over the concatenated inputs updates them (torch's own rule, not the runtime's merge)."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]

    def __enter__(self) -> None:
        self.seen: dict[int, list[torch.Tensor]] = {id(bn): [] for bn in self.layers}
        self.saved = [{k: v.clone() for k, v in bn.named_buffers()} for bn in self.layers]
        self.hooks = [bn.register_forward_pre_hook(self._record) for bn in self.layers]

    def _record(self, bn: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.seen[id(bn)].append(args[0].detach().clone())

    def __exit__(self, *exc: Any) -> None:
        for h in self.hooks:
            h.remove()
        with torch.no_grad():
            for bn, saved in zip(self.layers, self.saved):
                for k, v in bn.named_buffers():
                    v.copy_(saved[k])
                F.batch_norm(
                    torch.cat(self.seen[id(bn)]), bn.running_mean, bn.running_var, training=True, momentum=bn.momentum
                )
                bn.num_batches_tracked += 1


def nan_raise(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """A clean step exact; a batch with a NaN raises on every rank naming where, and no weight moves."""
    b = build(row, column, ctx)
    train_compare(b, f"{row} x {column}", steps=2)
    before = {n: p.detach().clone() for n, p in b.pipe.named_parameters()}
    x, y = _poisoned(*b.data(5))
    raises(
        sw.PipelineError, ["non-finite", "no optimizer stepped"], lambda: b.pipe.train_step(*b.pipe.local_batch(x, y))
    )
    for n, p in b.pipe.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} moved in a raised step"
    return {"raised": True}


def nan_skip(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """A NaN batch skipped on every rank (counted, no weight moves); the clean steps around it exact."""
    b = build(row, column, ctx)
    opt = torch.optim.SGD(b.ref.parameters(), lr=LR)  # type: ignore[union-attr]
    for step in range(3):
        x, y = b.data(step)
        if step == 1:
            before = {n: p.detach().clone() for n, p in b.pipe.named_parameters()}
            b.pipe.train_step(*b.pipe.local_batch(*_poisoned(x, y)))
            assert b.pipe.skipped_steps == 1
            for n, p in b.pipe.named_parameters():
                assert torch.equal(p.detach(), before[n]), f"{n} moved in a skipped step"
            continue
        loss = b.pipe.train_step(*b.pipe.local_batch(x, y))
        want = reference_step(b, x, y, opt)
        assert abs(loss - want) <= 1e-10 * (1 + abs(want)), (step, loss, want)
        assert_params_close(b.pipe, ref_named(b, b.pipe), f"{row} x {column} step {step}", aliases=True)
    return {"skipped": b.pipe.skipped_steps}


def _poisoned(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN in the first sample's inputs; token ids cannot hold one, so there a label marks the batch (whose
    loss :func:`matrix_models.hf_loss` makes NaN)."""
    if not x.is_floating_point():
        y = y.clone()
        y[0, -1] = POISON
        return x, y
    bad = x.clone()
    bad[0, 0] = float("nan")
    return bad, y


def autocast(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """bfloat16 autocast on a float32 model: the pipeline equals the one-process model under the same autocast,
    far closer than that model is to itself without autocast (so a pipeline ignoring autocast= would fail)."""
    b = build(row, column, ctx)
    plain = copy.deepcopy(b.ref)
    b.ref = b.ref.float()  # type: ignore[union-attr]
    plain = plain.float()  # type: ignore[union-attr]
    x, y = b.data(0)
    x = x.float() if x.is_floating_point() else x
    loss = b.pipe.train_step(*b.pipe.local_batch(x, y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = float(b.loss_fn(b.ref(x), y))
    full = float(b.loss_fn(plain(x), y))
    gap = abs(want - full)
    assert gap > 1e-5, f"autocast changed the loss by only {gap}: the check could not tell"
    assert abs(loss - want) <= gap / 20, f"{row} x autocast: {loss} vs {want} (fp32 {full})"
    return {"loss": loss, "gap": gap}


def measure_memory(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Training exact with the meter on, and the bytes each local stage's first forward saved equal to what the
    same stage saves for backward in one process on the same input."""
    b = build(row, column, ctx)
    train_compare(b, f"{row} x {column}", steps=2)
    report = b.pipe.memory_report()
    assert report["peak_bytes"] > 0 and report["forward_bytes"], report
    if row != "from_hf":
        for s in b.pipe.local_stages:
            want = _saved_bytes(b, s)
            assert report["forward_bytes"][(s, 0)] == want, (s, report["forward_bytes"], want)
    return {"peak": report["peak_bytes"], "stages": sorted({s for s, _ in report["forward_bytes"]})}


def _saved_bytes(b: Built, s: int) -> int:
    """What stage ``s`` of the one-process MLP saves for backward on one micro-batch (its loss too, if last):
    each distinct tensor autograd saves, parameters left out, counted by torch's saved-tensor hooks."""
    assert b.ref is not None
    children = list(getattr(b.ref, "model", b.ref).children())
    per = len(children) // b.pipe.num_ranks
    params = {p.untyped_storage().data_ptr() for p in b.ref.parameters()}
    seen: dict[tuple[Any, ...], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in params):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            seen.setdefault(key, t.numel() * t.element_size())
        return t

    x, y = mlp_data(0)
    x = x[: BATCH // M].detach().requires_grad_(s > 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = nn.Sequential(*children[s * per : (s + 1) * per])(x)
        if s == b.pipe.schedule.num_stages - 1:
            b.loss_fn(out, y[: BATCH // M]) * (1 / M)
    return sum(seen.values())


def checkpoint(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Save after a step; a fresh pipeline loads it and both train on alike, to the bit; the one-process model
    loads it too, equal to the saved pipeline's parameters."""
    root = Path(os.environ.get("MATRIX_DIR", "/tmp/sw-matrix")) / row
    if ctx.rank == 0 and root.exists():
        shutil.rmtree(root)
    torch.distributed.barrier()
    a = build(row, column, ctx)
    x, y = a.data(0)
    a.pipe.train_step(*a.pipe.local_batch(x, y))
    sw.checkpoint.save(root, a.pipe, step=1)
    b = build(row, column, ctx, shift=0.5, **({"seed": SEED + 1} if row in ("layers", "from_plan") else {}))
    sw.checkpoint.load(root, b.pipe)
    assert_params_close(b.pipe, _as_module(a.pipe), "loaded", rtol=0, atol=0)
    x, y = a.data(1)
    la = a.pipe.train_step(*a.pipe.local_batch(x, y))
    lb = b.pipe.train_step(*b.pipe.local_batch(x, y))
    assert la == lb, (la, lb)
    assert_params_close(b.pipe, _as_module(a.pipe), "trained on after the load", rtol=0, atol=0)
    return {"losses": [la, lb]}


def _as_module(pipe: Any) -> nn.Module:
    """A module whose named parameters are ``pipe``'s (to compare two pipelines by name)."""
    holder = nn.Module()
    holder.named_parameters = pipe.named_parameters  # type: ignore[method-assign]
    return holder


def asynchronous(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """pipedream against the one-process replay of its rule (weight stashing), window by window."""
    b = build(row, column, ctx, **({"loss_weights": None} if row == "from_hf" else {}))
    data = [b.data(k) for k in range(6)]
    losses = list(b.pipe.train_stream(b.pipe.local_batch(x, y) for x, y in data))
    layers, twin = _replay_layers(row, b)
    ref = sw.runtime.async_reference(layers, b.pipe.schedule, sgd, data, loss_fn=b.loss_fn, seed=SEED)
    worst = max(abs(a - r) for a, r in zip(losses, ref.losses))
    assert worst <= 1e-10, (losses, ref.losses)
    moved = max(abs(a - losses[0]) for a in losses)
    assert moved > 1e-6, "the losses did not move: the check would not see a wrong update"
    twin = twin if twin is not None else ref.model
    assert_params_close(b.pipe, ref_named(Built(b.pipe, twin, b.data, b.loss_fn), b.pipe), f"{row} x async")
    return {"worst": worst}


def _replay_layers(row: str, b: Built) -> tuple[Any, nn.Module | None]:
    """The layer list the replay trains, and the module whose parameters it trains in place (None: the replay's
    own model): the row's MLP, a built model's modules as they started, or the causal LM's per-layer units."""
    if row in ("layers", "from_plan"):
        return mlp_layers(), None
    assert b.ref is not None
    if row == "from_hf":
        from stagewise.runtime.frontends.hf import HFStage, recognise

        model = b.ref.model  # type: ignore[union-attr]
        layout = recognise(model)
        n = len(model.get_submodule(layout.layers))
        return [HFStage(model, layout, [k], first=k == 0, last=k == n - 1) for k in range(n)], b.ref
    if row == "from_stages":
        return list(b.ref.model.children()), b.ref  # type: ignore[union-attr]
    return list(b.ref.children()), b.ref


# ---- the one step protocol: options that reach every window of an asynchronous stream -------------------
def async_nan_in_a_later_window(ctx: Ctx) -> dict[str, Any]:
    """pipedream with the defaults (nan_policy="raise"): a NaN input in the third window raises on every rank,
    naming the mini-batch of the stream, and the stage that found it did not step."""
    pipe = sw.Pipeline(mlp_layers(), loss_fn=F.cross_entropy, schedule="pipedream", microbatches=2, optimizer=sgd,
                       seed=SEED, timeout=60.0)  # fmt: skip
    size = pipe.schedule.meta["versions"].minibatches
    data = [mlp_data(k) for k in range(3 * size)]
    bad = 2 * size + 1  # in the third window
    data[bad] = _poisoned(*data[bad])
    seen: list[float] = []

    def stream() -> None:
        for loss in pipe.train_stream(data):
            seen.append(loss)

    text = raises(sw.PipelineError, ["non-finite", f"mini-batch {bad}"], stream)
    assert len(seen) == 2 * size, f"the first two windows trained ({len(seen)} losses): {text}"
    return {"message": text.splitlines()[0]}


def async_batchnorm(policy: str) -> Check:
    """pipedream with batchnorm=policy: the running statistics of the one-process replay of the rule, updated
    per micro-batch's F ("micro") or once per mini-batch over its micro-batches ("deferred")."""

    def check(ctx: Ctx) -> dict[str, Any]:
        layers = mlp_layers(bn=True)
        schedule = sw.schedules.async_schedule("pipedream", ctx.world, 3, 2)  # windows of 3 mini-batches of 2
        pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule=schedule, optimizer=sgd, batchnorm=policy,
                           seed=SEED, timeout=60.0)  # fmt: skip
        data = [mlp_data(k) for k in range(6)]
        losses = list(pipe.train_stream(data))
        ref = sw.runtime.async_reference(
            layers, pipe.schedule, sgd, data, loss_fn=F.cross_entropy, seed=SEED, batchnorm=policy
        )
        assert max(abs(a - r) for a, r in zip(losses, ref.losses)) <= 1e-10, (losses, ref.losses)
        assert_params_close(pipe, ref.model, f"pipedream, batchnorm={policy!r}", buffers=True)
        tracked = [int(t) for n, t in pipe.named_buffers() if n.endswith("num_batches_tracked")]
        assert tracked in ([], [6 if policy == "deferred" else 12]), tracked  # 6 mini-batches of 2 micro-batches
        return {"tracked": tracked}

    return check


def auto_schedule(ctx: Ctx) -> dict[str, Any]:
    """schedule="auto": synthesized on every rank alike for the profiled layers, exact like any schedule; refused
    without sample_inputs, and for a way in that is not a layer list."""
    layers = mlp_layers()
    raises(ValueError, "pass sample_inputs=", lambda: sw.Pipeline(layers, schedule="auto", loss_fn=F.cross_entropy))
    raises(ValueError, "schedule='auto' profiles a layer list", lambda: sw.Pipeline.from_model(
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()), schedule="auto"))  # fmt: skip
    x, _ = mlp_data(0)
    b = Built(
        sw.Pipeline(
            layers,
            schedule="auto",
            sample_inputs=x[:2],
            loss_fn=F.cross_entropy,
            optimizer=sgd,
            microbatches=M,
            seed=SEED,
            timeout=60.0,
        ),  # fmt: skip
        sw.build_model(layers, seed=SEED),
        mlp_data,
        F.cross_entropy,
    )
    report = b.pipe.schedule.meta.get("synthesis")
    assert report is not None, "the schedule was not synthesized"
    mine = gather_objects(b.pipe.schedule.to_text(), None)
    assert len(set(mine)) == 1, "ranks synthesized different schedules"
    return {"losses": train_compare(b, "schedule='auto'"), "partition": [len(r) for r in b.pipe.layer_ranges]}


def tied_then_tied_on_a_mesh(ctx: Ctx) -> dict[str, Any]:
    """A tied pipeline over the world (its tied group: ranks 0 and 3), then a tied one on a pp 2 x dp 2 mesh
    in the same processes: the second's groups are made without a hang, and it trains exactly (torch's groups
    made by their members alone used to leave later ones out of step)."""
    first = build_row("layers", {"optimizer": sgd, "microbatches": M}, tied=True, ctx=ctx)
    train_compare(first, "tied, pp 4", steps=2)
    options = {"optimizer": sgd, "microbatches": M, "parallel": sw.ParallelConfig(pp=2, dp=2)}
    second = build_row("layers", options, tied=True, ctx=ctx)
    return {"losses": train_compare(second, "tied, pp 2 x dp 2")}


PROTOCOL: dict[str, Check] = {
    "protocol-tied-groups-twice": tied_then_tied_on_a_mesh,
    "protocol-auto-schedule": auto_schedule,
    "protocol-async-nan-later-window": async_nan_in_a_later_window,
    "protocol-async-batchnorm-deferred": async_batchnorm("deferred"),
    "protocol-async-batchnorm-micro": async_batchnorm("micro"),
}


COLUMNS: dict[str, Callable[[str, str, Ctx], dict[str, Any]]] = {
    "bn_micro": batchnorm,
    "bn_deferred": batchnorm,
    "nan_raise": nan_raise,
    "nan_skip": nan_skip,
    "autocast": autocast,
    "measure_memory": measure_memory,
    "checkpoint": checkpoint,
    "async": asynchronous,
}

__all__ = ["BATCH", "checks"]
