"""A live re-layout against a restart of the same change (process start, build, load), part by part, on local ranks.

    .venv/bin/python -m benchmarks.relayout                 # 1 and 4 MiB of parameters and Adam state per rank
    .venv/bin/python -m benchmarks.relayout --mib 10 100 1024 --ranks 2 --repeats 3

A float32 MLP of ``Linear(d, d)`` layers (8 per rank) as a 1F1B pipeline on 2 or 4 gloo ranks with the pipeline's own
Adam, one step trained (so Adam's state exists; parameters and state about ``--mib`` MiB per rank). Then the
partition moves back and forth between an even cut and one shifted by a layer, twice per repeat, each way:

* ``pipe.relayout(partition=...)``: its own parts (agreement, groups, build, move, fill, commit, release:
  ``Layout.seconds``) and the bytes that crossed processes;
* a restart: every rank starts a new interpreter importing torch and stagewise at once (``start``: timed on
  rank 0; the new processes' rendezvous is not counted), then ``sw.checkpoint.save`` + a new Pipeline of the
  new cut + ``sw.checkpoint.load`` in the running processes.

Reported on rank 0 (the median over the moves): seconds per part, MiB moved and MiB/s, and the ratio of the two
totals. Timings depend on the machine's load: report ``uptime`` beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._launch import launched, on_ranks

PER_RANK = 8


def _model(d: int, ranks: int) -> list[Any]:
    import torch
    from torch import nn

    import stagewise as sw

    return [sw.Layer(nn.Linear, d, d, dtype=torch.float32) for _ in range(ranks * PER_RANK)]


def _start() -> float:
    """Seconds for a new interpreter to import torch and stagewise (every rank starts one at once)."""
    import subprocess

    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, stagewise"], check=True)
    return time.perf_counter() - started


def _width(mib: float) -> int:
    """d such that PER_RANK layers of d*d+d float32 parameters, with Adam's two moments, hold ``mib`` MiB."""
    per_layer = mib * 2**20 / (3 * 4 * PER_RANK)
    return max(8, int(per_layer**0.5))


def _one(mib: float, repeats: int, ranks: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    d = _width(mib)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    options: dict[str, Any] = {"loss_fn": torch.nn.functional.mse_loss, "optimizer": adam, "microbatches": 4}
    cuts = [[PER_RANK] * ranks, [PER_RANK + 1, PER_RANK - 1] + [PER_RANK] * (ranks - 2)]
    x = torch.randn(8, d)
    pipe = sw.Pipeline(_model(d, ranks), partition=cuts[0], **options)
    pipe.train_step(x, x)
    live: list[dict[str, float]] = []
    restart: list[dict[str, float]] = []
    root = Path(tempfile.gettempdir()) / "sw-relayout-bench"
    for k in range(2 * repeats):
        cut = cuts[(k + 1) % 2]
        layout, memory = _measured(pipe, cut, (d * d + d) * 4)
        live.append({**layout.seconds, "mib": layout.bytes_moved / 2**20, **memory})
        dist.barrier()
        start = _start()
        dist.barrier()
        started = time.perf_counter()
        sw.checkpoint.save(root, pipe, step=k, keep=1)
        saved = time.perf_counter()
        fresh = sw.Pipeline(_model(d, ranks), partition=cuts[k % 2], **options)
        built = time.perf_counter()
        sw.checkpoint.load(root, fresh)
        restart.append(
            {"start": start, "save": saved - started, "build": built - saved, "load": time.perf_counter() - built}
        )
        del fresh
    return {"d": d, "live": live, "restart": restart}


def _measured(pipe: Any, cut: list[int], layer: int) -> tuple[Any, dict[str, int]]:
    """One re-layout under :class:`LiveBytes`: its extra tensor bytes on this rank, and two bounds: issue 46's (the
    larger of this rank's state before and after, plus one layer: ``layer`` bytes, every layer alike here) and
    the tight one (the state after less what stayed in place, plus one layer)."""
    # internal: the re-layout's extra tensor bytes, counted as the test of issue 46's bound counts them
    from stagewise.runtime.measure.tensor_bytes import LiveBytes, state_tensors, storage_bytes

    state = state_tensors(pipe)
    before, held = storage_bytes(state), {t.untyped_storage().data_ptr() for t in state}
    del state
    with LiveBytes().hold(state_tensors(pipe)) as live:
        layout = pipe.relayout(partition=cut)
    state = state_tensors(pipe)
    after, kept = storage_bytes(state), storage_bytes(t for t in state if t.untyped_storage().data_ptr() in held)
    return layout, {"extra": live.extra, "bound": max(before, after) + layer, "tight": after - kept + layer}


def _memory(mib: float, ranks: list[dict[str, Any]]) -> list[str]:
    """Per rank, the move with the largest extra bytes and its bounds."""
    rows = []
    for r, got in enumerate(ranks):
        worst = max(got["live"], key=lambda row: row["extra"])
        extra, bound, tight = (worst[k] / 2**20 for k in ("extra", "bound", "tight"))
        within = "yes" if extra <= min(bound, tight) else "NO"
        rows.append(f"| {mib:g} | {r} | {extra:.2f} | {bound:.2f} | {tight:.2f} | {within} |")
    return rows


def _report(mib: float, got: dict[str, Any]) -> str:
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    live, restart = got["live"], got["restart"]
    parts = ["agreement", "groups", "build", "move", "fill", "commit", "release"]
    again_parts = ("start", "save", "build", "load")
    live_total = sum(med(live, p) for p in parts)
    restart_total = sum(med(restart, p) for p in again_parts)
    moved = med(live, "mib")
    rate = moved / med(live, "move") if med(live, "move") > 0 else float("nan")
    cells = " | ".join(f"{med(live, p) * 1e3:.1f}" for p in parts)
    again = " | ".join(f"{med(restart, p) * 1e3:.1f}" for p in again_parts)
    return (
        f"| {mib:g} | {got['d']} | {cells} | {live_total * 1e3:.1f} | {moved:.2f} | {rate:.0f} | {again} "
        f"| {restart_total * 1e3:.1f} | {restart_total / live_total:.1f}x |"
    )


def worker(args: argparse.Namespace) -> None:
    import torch

    import stagewise as sw

    torch.set_num_threads(1)
    import torch.distributed as dist

    env = sw.init()
    rows, memory = [], []
    for mib in args.mib:
        got = _one(mib, args.repeats, env.world_size)
        rows.append(_report(mib, got))
        everyone: list[Any] = [None] * env.world_size
        dist.all_gather_object(everyone, got)
        memory += _memory(mib, everyone)
    if env.rank == 0:
        head = (
            f"{env.world_size} ranks\n| MiB/rank | d | agree ms | groups ms | build ms | move ms | fill ms | commit ms "
            "| release ms | re-layout ms | MiB moved | MiB/s | start ms | save ms | build ms | load ms | restart ms "
            "| ratio |"
        )
        extra = "\nextra tensor bytes per rank (not RSS), the worst move\n"
        extra += "| MiB/rank | rank | extra MiB | bound MiB | tight MiB | within |"
        table = [head, "|---" * 18 + "|", *rows, extra, "|---" * 6 + "|", *memory]
        print("\n".join(table), flush=True)  # noqa: T201 (a benchmark's table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[1.0, 4.0], help="parameters + Adam, MiB per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4, help="processes (2 or more)")
    args = parser.parse_args()
    if launched():
        worker(args)
    else:
        sys.exit(on_ranks(args.ranks, "benchmarks.relayout", sys.argv[1:], OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    main()
