"""Run under ``torchrun -m stagewise.runtime.measure.cores`` (each rank pinned a core, as ``stagewise run
--pin-cores``): a 2-rank pipeline calibrated with no cores given; each rank prints one JSON line of what its
calibrator recorded into its own file in ``$PINNED_OUT`` (tests/distributed/test_pinned_ranks.py reads them; two
ranks printing to one stdout interleave their lines)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.calibration.from_run import RunCalibrator

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        pipe = sw.Pipeline([nn.Linear(4, 4), nn.Linear(4, 4)], loss_fn=F.mse_loss, schedule="1f1b", microbatches=2)
        calibrator = RunCalibrator(pipe, warmup=0, after=1)
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        pipe.train_step(x, y)
        calibrator.observe()
        record = calibrator.records[0]
        mine = sorted(os.sched_getaffinity(0))
        keys = ("cores", "affinity", "pinned")
        row = {"rank": dist.get_rank(), "own": mine, **{k: record[k] for k in keys}}
        (Path(os.environ["PINNED_OUT"]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()
