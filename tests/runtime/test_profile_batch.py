"""``sw.profile`` records the samples it measured, so that the planner scales its costs by the right batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stagewise as sw


def test_the_profile_records_its_batch() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    profile = sw.profile(model, torch.randn(6, 4), repeats=1, warmup=0)
    assert profile.batch == 6
    assert sw.LayerProfile.from_json(profile.to_json()).batch == 6
    assert sw.profile(model, torch.randn(6, 4), repeats=1, warmup=0, batch=3).batch == 3  # said otherwise
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        sw.profile(model, torch.randn(6, 4), repeats=1, warmup=0, batch=0)
