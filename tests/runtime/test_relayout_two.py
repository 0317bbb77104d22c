"""Re-layouts of two pipelines in one process: each lets go only of the groups its own last re-layout made."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.runtime.relayout import call


def test_two_pipelines_in_one_process_keep_their_own_groups_across_re_layouts(one_rank: object) -> None:
    def layers() -> list[sw.Layer]:
        return [sw.Layer(nn.Linear, 4, 8), sw.Layer(nn.ReLU), sw.Layer(nn.Linear, 8, 3)]

    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    a = sw.Pipeline(layers(), loss_fn=F.cross_entropy, microbatches=2)
    b = sw.Pipeline(layers(), loss_fn=F.cross_entropy, microbatches=2)
    a.relayout(schedule="gpipe")
    made_for_a = list(call._owned[a])
    b.relayout(schedule="gpipe")
    assert call._owned[a] == made_for_a and all(g not in made_for_a for g in call._owned[b])
    assert all(dist.get_world_size(g) == 1 for g in made_for_a)  # not destroyed by b's re-layout
    a.train_step(x, y)
    b.train_step(x, y)
