"""Cut an unmodified nn.Module into pipeline stages: at ``pipeline_stage`` tags, or at balanced block boundaries.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
>>> model[2].pipeline_stage = 1
>>> split = split_model(model, torch.randn(3, 4))
>>> split.num_stages, split.stage_inputs[1]
(2, ('_1',))
>>> torch.equal(split.run(torch.ones(3, 4)), model(torch.ones(3, 4)))
True
"""

from .model import BoundaryValue, SplitModel, split_model
from .tags import collect_tags, stage, tag_of
from .trace import SplitError

__all__ = ["BoundaryValue", "SplitError", "SplitModel", "collect_tags", "split_model", "stage", "tag_of"]
