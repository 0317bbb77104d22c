"""(a) float64 parity: several stages on one rank (V-shape and interleaved schedules put 2 and 4 there), and
two processes sharing the device over gloo, against the one-process model trained alike on the same device.

Two processes on one GPU cannot use NCCL (it refuses two ranks on one device): they use a gloo group with
``device="cuda"``. gloo's point-to-point moves CPU tensors only, so the ``torch`` transport is expected to
fail there, naming why; the ``shm`` transport stages each CUDA tensor through its shared-memory slot (a
device-to-host copy on the sender, host-to-device on the receiver). Both are tried and reported.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import stagewise as sw

from .._launch import environ, torchrun
from .common import Row, Sizes, lm_data, lm_layers, lm_loss

TOL = 1e-10


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_both(pipe: sw.Pipeline, layers: list[sw.Layer], s: Sizes, device: torch.device, seed: int) -> float:
    """Two steps on the pipeline and on the one-process model: the worst relative error (losses, parameters)."""
    ref = sw.build_model(layers, seed=seed).to(device)
    opt = sgd(list(ref.parameters()))
    worst = 0.0
    for step in range(2):
        x, y = lm_data(s, step, device)
        loss = pipe.train_step(*pipe.local_batch(x, y))
        opt.zero_grad()
        want = lm_loss(ref(x), y)
        want.backward()
        opt.step()
        worst = max(worst, abs(loss - want.item()) / abs(want.item()))
    mine = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        q = mine[name].detach()
        worst = max(worst, float((p.detach() - q).abs().max() / q.abs().max().clamp_min(1e-30)))
    return worst


def one_process(s: Sizes, device: torch.device) -> list[Row]:
    rows = []
    layers = lm_layers(s, torch.float64)
    for schedule, v in (("zb-v", 2), ("interleaved-1f1b", 4)):
        pipe = sw.Pipeline(layers, loss_fn=lm_loss, schedule=schedule, virtual_stages=v, microbatches=s.microbatches,
                           optimizer=sgd, device=device, seed=5)  # fmt: skip
        err = train_both(pipe, layers, s, device, seed=5)
        rows.append(Row("a", f"float64 parity, 1 rank, {schedule} ({v} stages on it)", f"{err:.1e}", f"<= {TOL:g}",
                        err <= TOL))  # fmt: skip
    return rows


def two_processes(s: Sizes, device: torch.device) -> list[Row]:
    """The pair, as a torchrun job of 2 processes on this device (see :func:`pair_worker`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pair.json"
        cmd = torchrun(2, "benchmarks.gpu_check", ["--pair", "--device", device.type, "--out", str(out)])
        proc = subprocess.run(cmd, env=environ(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
        if not out.exists():
            tail = (proc.stdout + proc.stderr)[-400:].replace("\n", " ")
            return [Row("a", "float64 parity, 2 processes (gloo)", f"job failed: {tail}", f"<= {TOL:g}", False)]
        found = json.loads(out.read_text())
    rows = []
    for transport, result in found.items():
        what = f"float64 parity, 2 processes on one {device.type}, gloo, transport={transport!r}"
        if "error" in result:
            rows.append(Row("a", what, f"{result['error']:.1e}", f"<= {TOL:g}", result["error"] <= TOL))
        else:
            rows.append(Row("a", what, f"unsupported: {result['failed'][:160]}", "(reported)", None))
    return rows


def pair_worker(device_type: str, out: str) -> None:
    """One of the pair's two processes: each transport tried in turn; rank 0 writes what happened."""
    env = sw.init(backend="gloo", device="cpu" if device_type == "cpu" else "cuda:0")
    s = Sizes.of(env.device)
    layers = lm_layers(s, torch.float64)
    found: dict[str, Any] = {}
    for transport in ("shm", "torch"):
        try:
            pipe = sw.Pipeline(layers, loss_fn=lm_loss, schedule="1f1b", microbatches=s.microbatches, optimizer=sgd,
                               transport=transport, device=env.device, seed=5, timeout=30.0)  # fmt: skip
            err = torch.tensor([train_both(pipe, layers, s, env.device, seed=5)], dtype=torch.float64)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            found[transport] = {"error": float(err)}
        except Exception as e:  # noqa: BLE001 - what failed is the finding
            found[transport] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if env.rank == 0:
        Path(out).write_text(json.dumps(found))


def run(s: Sizes, device: torch.device) -> list[Row]:
    return one_process(s, device) + two_processes(s, device)
