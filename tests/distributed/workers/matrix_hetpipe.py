"""The HetPipe row of the combination matrix: two virtual workers of two ranks each, against the one-process
replay of the wave-synchronous rule (``wsp_reference``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import stagewise as sw
from helpers.compare import assert_params_close
from matrix_models import BATCH, SEED, Built, mlp_data, mlp_layers
from oracles.wsp_reference import wsp_reference
from worker import Ctx, raises

WORKERS = [[0, 1], [2, 3]]
WAVES = 3


def _options(column: str, options: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in options.items() if k != "microbatches"}
    out.setdefault("schedule", "1f1b")
    out["microbatches"] = 2
    return out


def build_hetpipe(column: str, options: dict[str, Any], dtype: torch.dtype = torch.float64) -> Built:
    layers = mlp_layers(bn=column in ("bn_micro", "bn_deferred"), dtype=dtype)
    if column == "tied":
        from matrix_models import tied_layers

        layers = tied_layers()
    opts = {"seed": SEED, "timeout": 60.0, **_options(column, options)}
    het = sw.HetPipe(layers, virtual_workers=WORKERS, staleness=0, loss_fn=F.cross_entropy, **opts)
    return Built(het, None, lambda step: mlp_data(step, dtype), F.cross_entropy)


def _reference(het: Any, data: list[Any], options: dict[str, Any], **more: Any) -> Any:
    streams = [[_share(x, y, v) for x, y in data] for v in range(len(WORKERS))]
    return wsp_reference(
        mlp_layers(dtype=more.pop("dtype", torch.float64)),
        streams,
        stages=[len(w) for w in WORKERS],
        loss_fn=F.cross_entropy,
        optimizer=options["optimizer"],
        staleness=0,
        schedule=options.get("schedule", "1f1b"),
        microbatches=2,
        seed=SEED,
        counts=het.stage_counts,
        **more,
    )


def _share(x: torch.Tensor, y: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = len(WORKERS)
    return x.tensor_split(k)[v], y.tensor_split(k)[v]


def hetpipe_cell(column: str, ctx: Ctx) -> dict[str, Any]:
    from matrix_build import column_options

    options = column_options("hetpipe", column)
    dtype = torch.float32 if column == "autocast" else torch.float64
    b = build_hetpipe(column, options, dtype)
    het = b.pipe
    data = [b.data(k) for k in range(WAVES)]
    losses = list(het.train_stream(het.local_batch(x, y) for x, y in data))
    more: dict[str, Any] = {"dtype": dtype}
    if column == "autocast":
        more["autocast"] = torch.bfloat16
    if column in ("clip", "lr_scheduler"):
        more[column] = options[column]
    ref = _reference(het, data, options, **more)
    tol = 1e-5 if column == "autocast" else 1e-10
    worst = max(abs(a - r) for a, r in zip(losses, ref.losses[het.vw]))
    assert worst <= tol, (column, losses, ref.losses[het.vw])
    assert_params_close(het, ref.model, f"hetpipe x {column}", rtol=tol, atol=tol)
    if column == "autocast":
        plain = _reference(het, data, options, dtype=dtype)
        gap = max(abs(a - r) for a, r in zip(plain.losses[het.vw], ref.losses[het.vw]))
        assert gap > 20 * max(worst, 1e-12), f"autocast made no difference to the replay ({gap}): a useless check"
    if column in ("clip", "lr_scheduler"):
        _owned(het, data, options, ref, column, dtype)
    if column == "nan_raise":
        bad = [b.data(9)]
        if het.vw == 1:
            x, y = bad[0]
            x = x.clone()
            x[-1, 0] = float("nan")  # in VW 1's share only: VW 0 must stop too
            bad = [(x, y)]
        raises(sw.PipelineError, "non-finite", lambda: list(het.train_stream(het.local_batch(x, y) for x, y in bad)))
    if column == "measure_memory":
        assert het.pipe.memory_report()["peak_bytes"] > 0
    if column == "checkpoint":
        _checkpoint(het, b, options)
    return {"worst": worst, "batch": BATCH}


def _owned(het: Any, data: list[Any], options: dict[str, Any], ref: Any, column: str, dtype: torch.dtype) -> None:
    """clip=: each step's norm (this VW's whole model, in its metrics) equals the replay's, above the max norm;
    both: the replay without the option ends elsewhere, so the comparison above could tell."""
    if column == "clip":
        from stagewise.runtime.reporting.files import read_metrics, series

        het.pipe.metrics.close()
        got = [v for _, v in series(read_metrics(het.pipe.metrics.config.path, het.pipe.process_rank), "grad_norm")]
        want = ref.norms[het.vw]
        assert min(want) > 2 * options["clip"], f"hetpipe x clip=: norms {want} do not exceed {options['clip']}"
        assert len(got) == len(want) and all(abs(a - b) <= 1e-10 * b for a, b in zip(got, want)), (got, want)
    plain = _reference(het, data, options, dtype=dtype)
    gap = max(abs(a - r) for a, r in zip(plain.losses[het.vw], ref.losses[het.vw]))
    assert gap > 1e-6, f"hetpipe x {column}: the replay without it gives the same losses ({gap}): a useless check"


def _checkpoint(het: Any, b: Built, options: dict[str, Any]) -> None:
    """Each VW saves its pipeline (the global model, its own optimizer state) and the wave count; a fresh
    HetPipe loads them, and both train on alike, to the bit."""
    import os
    import shutil
    from pathlib import Path

    root = Path(os.environ.get("MATRIX_DIR", "/tmp/sw-matrix")) / "hetpipe"
    if het.rank == 0 and root.exists():
        shutil.rmtree(root)
    torch.distributed.barrier()
    sw.checkpoint.save(root, het, step=WAVES, extra={"data": WAVES})
    other = build_hetpipe("checkpoint", {**options, "seed": SEED + 1}).pipe
    info = sw.checkpoint.load(root, other)
    assert info.extra == {"data": WAVES} and other.stats.waves == het.stats.waves, info
    assert_params_close(other, het.pipe, "loaded", rtol=0, atol=0)
    more = [b.data(WAVES + k) for k in range(2)]
    la = list(het.train_stream(het.local_batch(x, y) for x, y in more))
    lb = list(other.train_stream(other.local_batch(x, y) for x, y in more))
    assert la == lb, (la, lb)
    assert_params_close(other, het.pipe, "trained on after the load", rtol=0, atol=0)
