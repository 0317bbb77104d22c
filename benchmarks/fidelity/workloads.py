"""The three workloads the fidelity benchmark runs, each a layer list (``schedule="auto"`` takes only those).

* ``gpt64``: the demo's GPT (``examples/gpt_stdlib.py``'s model, ``examples/gpt_model.py``: d 64, 4 heads,
  6 blocks, sequence 64, vocabulary 256, the head tied to the token embedding), micro-batches of 4 sequences
  (the demo's 32 over 8 micro-batches);
* ``gpt256``: the same code at d 256, 8 pre-norm blocks, 4 heads, sequence 64, vocabulary 512, micro-batches
  of 2 sequences (issue 39's workload);
* ``resnet``: ``examples/resnet_digits.py``'s ResNet as 9 layers (stem, its six basic blocks, pooling, the
  classifier: enough for 4 ranks x 2 virtual stages), micro-batches of 16 random 8 x 8 images.

All float32. The data are random (tokens, images): only times and bytes are measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw

from .._examples import example


@dataclass(frozen=True)
class Workload:
    """A model as layer specs, its loss, and how many samples one micro-batch holds."""

    name: str
    title: str
    layers: Callable[[], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # samples -> (inputs, targets)
    microbatch: int  # samples per micro-batch
    d_model: int  # the width the split backward's targets depend on (0: not a transformer)


def _gpt(d: int, blocks: int, vocab: int) -> tuple[Callable[[], Any], Callable[[int], tuple[torch.Tensor, ...]]]:
    gpt = example("gpt_model")
    cfg = gpt.GPTConfig(vocab_size=vocab, seq_len=64, d_model=d, n_heads=4, n_layers=blocks)

    def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (samples, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        return ids[:, :-1], ids[:, 1:]

    def layers() -> Any:
        return gpt.gpt_layers(cfg)

    return layers, data


class Stem(nn.Module):
    """The ResNet's first convolution, BatchNorm and ReLU (``ResNet.head``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Pool(nn.Module):
    """Global average pooling (the ResNet's ``x.mean(dim=(2, 3))``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def resnet_layers(width: int = 16) -> list[sw.Layer]:
    """``examples/resnet_digits.py``'s ``ResNet`` block by block."""
    block = example("resnet_digits").BasicBlock
    w = width
    blocks = [(w, w, 1), (w, w, 1), (w, 2 * w, 2), (2 * w, 2 * w, 1), (2 * w, 4 * w, 2), (4 * w, 4 * w, 1)]
    return [
        sw.Layer(Stem, w),
        *(sw.Layer(block, a, b, s) for a, b, s in blocks),
        sw.Layer(Pool),
        sw.Layer(nn.Linear, 4 * w, 10),
    ]


def _images(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(samples, 1, 8, 8, generator=g), torch.randint(0, 10, (samples,), generator=g)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return example("gpt_model").lm_loss(logits, targets)  # type: ignore[no-any-return]


def workloads() -> dict[str, Workload]:
    """The workloads by name (each built on demand: loading the examples costs nothing until then)."""
    layers64, data64 = _gpt(64, 6, 256)
    layers256, data256 = _gpt(256, 8, 512)
    return {
        "gpt64": Workload("gpt64", "demo GPT (d 64)", layers64, _lm_loss, data64, 4, 64),  # type: ignore[arg-type]
        "gpt256": Workload("gpt256", "GPT d 256", layers256, _lm_loss, data256, 2, 256),  # type: ignore[arg-type]
        "resnet": Workload("resnet", "ResNet (digits)", resnet_layers, F.cross_entropy, _images, 16, 0),
    }


NAMES = ("gpt64", "gpt256", "resnet")
