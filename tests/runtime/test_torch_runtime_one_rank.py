"""torch's ``_PipelineScheduleRuntime`` running stagewise schedules of two stages on one rank (a one-process gloo
group): float64 against one process, and why ``to_torch_csv`` refuses a last stage that runs its forwards out
of micro-batch order (torch loads it, then trains wrong: it reads each micro-batch's loss by position).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl
from helpers.compare import assert_grads_close
from stagewise.interop.torch_words import write_actions
from stagewise.runtime.interop import torch_pipelining_missing, torch_runtime

pytestmark = pytest.mark.skipif(torch_pipelining_missing() is not None, reason=str(torch_pipelining_missing()))

#: valid for stagewise; the last stage (1) runs micro-batch 1's forward before micro-batch 0's
OUT_OF_ORDER = "0F0 0F1 1F1 1F0 1B1 1B0 0B1 0B0"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(6, 6, dtype=torch.float64),
        nn.Linear(6, 3, dtype=torch.float64),
    )


def _torch_step(schedule: sw.Schedule, csv: Path | None = None) -> tuple[float, float, float]:
    """One step of torch's runtime on ``schedule`` (or the raw ``csv`` file); (its loss, the reference's, the
    largest gradient difference)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    ref = _model()
    cuts = [range(0, 2), range(2, 4)]
    modules = [nn.Sequential(OrderedDict((str(k), copy.deepcopy(ref[k])) for k in cut)) for cut in cuts]
    stages = [PipelineStage(mod, s, 2, torch.device("cpu")) for s, mod in enumerate(modules)]
    if csv is None:
        runtime = torch_runtime(schedule, stages, loss_fn=F.cross_entropy)
    else:  # what a file written without the check would do
        runtime = _PipelineScheduleRuntime(stages, schedule.num_microbatches, loss_fn=F.cross_entropy)
        runtime._load_csv(str(csv))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    losses: list[torch.Tensor] = []
    runtime.step(x, target=y, losses=losses)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    got = [p.grad for mod in modules for p in mod.parameters()]
    worst = max(float((a - b.grad).abs().max()) for a, b in zip(got, ref.parameters()))
    return torch.stack(losses).mean().item(), ref_loss.item(), worst


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_two_stages_on_one_rank_train_exactly_on_torchs_runtime(one_rank: object, name: str) -> None:
    loss, ref_loss, worst = _torch_step(sw.build_schedule(name, 1, 4, 2))
    assert loss == pytest.approx(ref_loss, rel=1e-12) and worst < 1e-12


def test_a_last_stage_out_of_order_trains_wrong_on_torch_which_is_why_it_is_refused(
    one_rank: object, tmp_path: Path
) -> None:
    schedule = sw.from_torch({0: OUT_OF_ORDER.split()})  # valid: stagewise trains it (below)
    with pytest.raises(ValueError, match="runs its forwards in the order"):
        sw.to_torch_csv(schedule)
    raw = tmp_path / "unchecked.csv"
    raw.write_text(",".join(write_actions(schedule.ranks[0], comms=False)) + "\n")
    loss, ref_loss, worst = _torch_step(schedule, raw)
    assert loss == pytest.approx(ref_loss, rel=1e-12)  # the same losses, filed in the wrong places
    assert worst > 1e-3  # so each backward starts from another micro-batch's loss: wrong gradients, no error
    layers = mdl.mlp(num_layers=4)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule=schedule, seed=3)
    ref = sw.build_model(layers, seed=3)
    x, y = mdl.mlp_data(8, seed=1)
    assert pipe.train_step(x, y) == pytest.approx(F.cross_entropy(ref(x), y).item(), rel=1e-12)
    F.cross_entropy(ref(x), y).backward()
    assert_grads_close(pipe, ref, "out of order, stagewise")
