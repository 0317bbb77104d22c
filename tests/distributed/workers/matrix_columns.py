"""The matrix columns with more to check than a plain exact run: what each option does, besides training
exactly (BatchNorm statistics, NaN raised or skipped, autocast, measured bytes, checkpoints, replays)."""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers.compare import assert_params_close
from matrix_build import LR, M, build, momentum, sgd, snapshot_folder
from matrix_models import BATCH, SEED, Built, mlp_data, mlp_layers
from matrix_reference import _poisoned, ref_named, reference_step, train_compare
from matrix_spec import EXACT, expected
from oracles.async_reference import async_reference
from worker import Ctx, raises


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


def snapshot(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Two steps with ``snapshot=1`` (SGD with momentum: state to keep), exact against the one-process model; a
    fresh pipeline resumes from step 2's snapshot (every parameter by name, to the bit), and both train on
    alike - the momentum came back too - to the bit."""
    root = Path(snapshot_folder(row))
    if ctx.rank == 0 and root.exists():
        shutil.rmtree(root)
    torch.distributed.barrier()
    a = build(row, column, ctx)
    losses = train_compare(a, f"{row} x {column}", steps=2, optimizer=momentum)
    a.pipe.snapshots.wait()
    b = build(row, column, ctx, shift=0.5, **({"seed": SEED + 1} if row in ("layers", "from_plan") else {}))
    info = sw.checkpoint.resume(root / "ckpt", b.pipe)
    assert info is not None and info.step == 2 and info.rng_restored, info
    assert_params_close(b.pipe, _as_module(a.pipe), "resumed", rtol=0, atol=0)
    x, y = a.data(2)
    la = a.pipe.train_step(*a.pipe.local_batch(x, y))
    lb = b.pipe.train_step(*b.pipe.local_batch(x, y))
    assert la == lb, (la, lb)
    assert_params_close(b.pipe, _as_module(a.pipe), "trained on after the resume", rtol=0, atol=0)
    return {"losses": [*losses, la, lb]}


def _as_module(pipe: Any) -> nn.Module:
    """A module whose named parameters are ``pipe``'s (to compare two pipelines by name)."""
    holder = nn.Module()
    holder.named_parameters = pipe.named_parameters  # type: ignore[method-assign]
    return holder


def offload(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    from matrix_offload import offload_cell

    return offload_cell(row, column, ctx)


def owned(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    import matrix_owned

    return getattr(matrix_owned, column)(row, column, ctx)  # type: ignore[no-any-return]


def asynchronous(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """pipedream against the one-process replay of its rule (weight stashing), window by window."""
    b = build(row, column, ctx, **({"loss_weights": None} if row == "from_hf" else {}))
    data = [b.data(k) for k in range(6)]
    losses = list(b.pipe.train_stream(b.pipe.local_batch(x, y) for x, y in data))
    layers, twin = _replay_layers(row, b)
    ref = async_reference(layers, b.pipe.schedule, sgd, data, loss_fn=b.loss_fn, seed=SEED)
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


def merge(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """Gradient merge at pp 2 x dp 2: two merges of two train steps (the first under ``no_sync()``), the optimizer
    stepped by the last STEP, against the one-process model calling backward once per batch before each step;
    HetPipe refuses ``no_sync()`` when it is called."""
    b = build(row, column, ctx)
    want = expected(row, column)
    if want != EXACT:
        raises(ValueError, want, b.pipe.no_sync)
        return {"refused": want}
    opt = sgd(list(b.ref.parameters()))  # type: ignore[union-attr]
    losses = []
    for group in range(2):
        opt.zero_grad(set_to_none=True)
        for k in range(2):
            x, y = b.data(2 * group + k)
            with b.pipe.no_sync() if k == 0 else _nothing():
                loss = b.pipe.train_step(*b.pipe.local_batch(x, y))
            ref_loss = b.loss_fn(b.ref(x), y)
            ref_loss.backward()
            assert abs(loss - float(ref_loss)) <= 1e-10 * (1 + abs(float(ref_loss))), (group, k, loss, ref_loss)
            losses.append(loss)
        opt.step()
        assert_params_close(b.pipe, ref_named(b, b.pipe), f"{row} x merge after merge {group}", aliases=True)
    return {"losses": losses}


def relayout(row: str, column: str, ctx: Ctx) -> dict[str, Any]:
    """After a step and a save, ``pipe.relayout(schedule="gpipe")`` (the same placement, so from_stages takes it
    too); a fresh GPipe pipeline loads the save: both hold the same tensors and train on alike, to the bit. The
    rows that cannot re-layout refuse the call alike on every rank."""
    a = build(row, column, ctx)
    want = expected(row, column)
    if want != EXACT:
        raises(ValueError, want, lambda: a.pipe.relayout(schedule="gpipe"))
        return {"refused": want}
    root = Path(os.environ.get("MATRIX_DIR", "/tmp/sw-matrix")) / f"relayout-{row}"
    x, y = a.data(0)
    a.pipe.train_step(*a.pipe.local_batch(x, y))
    sw.checkpoint.save(root, a.pipe, step=1)
    layout = a.pipe.relayout(schedule="gpipe")
    b = build(row, column, ctx, shift=0.5, schedule="gpipe", **({"seed": SEED + 1} if row == "layers" else {}))
    sw.checkpoint.load(root, b.pipe)
    assert_params_close(b.pipe, _as_module(a.pipe), "re-laid out", rtol=0, atol=0)
    x, y = a.data(1)
    la = a.pipe.train_step(*a.pipe.local_batch(x, y))
    lb = b.pipe.train_step(*b.pipe.local_batch(x, y))
    assert la == lb and layout.schedule == "gpipe", (la, lb, layout.schedule)
    assert_params_close(b.pipe, _as_module(a.pipe), "trained on after the re-layout", rtol=0, atol=0)
    return {"losses": [la, lb]}


# ---- the one step protocol: options that reach every window of an asynchronous stream -------------------
COLUMNS: dict[str, Callable[[str, str, Ctx], dict[str, Any]]] = {
    "bn_micro": batchnorm,
    "bn_deferred": batchnorm,
    "nan_raise": nan_raise,
    "nan_skip": nan_skip,
    "autocast": autocast,
    "measure_memory": measure_memory,
    "offload": offload,
    "checkpoint": checkpoint,
    "snapshot": snapshot,
    "async": asynchronous,
    "merge": merge,
    "relayout": relayout,
    **dict.fromkeys(("metrics", "progress", "lr_scheduler", "clip"), owned),
}
