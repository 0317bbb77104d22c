"""The comparison's workloads: a model as a list of layers, its data, its loss, and how to evaluate it.

Each :class:`Workload` gives every method the same thing: the layers (so a
Pipeline and ``sw.build_model`` build the same initial weights from a seed),
``count`` training mini-batches drawn from a seeded stream, fixed evaluation
sets, and the default learning rate (SGD with momentum 0.9 for all: XPipe's
weight prediction needs momentum).

* ``gpt``: the demo's byte-level GPT on the stdlib-source corpus, tiny
  (2 blocks, d_model 32, 32-byte windows); its head is an **untied** linear
  layer, because asynchronous schedules refuse tied modules (their copies would
  step at different times). Accuracy is next-byte accuracy.
* ``cnn``: the digits CNN of ``examples/digits_cnn.py`` (residual blocks,
  GroupNorm), narrower (width 16), as five layers: stem, three blocks, head.
* ``mlp``: the first comparison's MLP (64-128-128-128-10) on the flattened digits.
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

_cnn, _data, _gpt = example("digits_cnn"), example("gpt_data"), example("gpt_model")
ResBlock = _cnn.ResBlock
Block, GPTConfig, Positions = _gpt.Block, _gpt.GPTConfig, _gpt.Positions
gpt_batches, eval_batches, split, stdlib_corpus = _data.batches, _data.eval_batches, _data.split, _data.stdlib_corpus

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """One model and its data; every method trains it on the same mini-batches from the same initial weights."""

    name: str
    layers: Callable[[], Any]  # -> list or dict of sw.Layer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train: Callable[[int, int, int], list[Batch]]  # (count, batch size, seed) -> mini-batches
    eval_sets: Callable[[int], dict[str, Batch]]  # (micro-batches) -> {"train": ..., "val": ...}, sizes % m == 0
    accuracy: Callable[[torch.Tensor, torch.Tensor], float]
    lr: float
    batch: int  # default samples per mini-batch
    target_loss: float  # default target for "samples to target"
    description: str


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean())


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _whole(x: torch.Tensor, y: torch.Tensor, m: int) -> Batch:
    """The largest multiple of ``m`` samples, so every micro-batch of an evaluation is whole."""
    n = len(x) // m * m
    return x[:n], y[:n]


# ---- digits: the MLP and the CNN -----------------------------------------------------------------


def load_digits(test_size: int = 297, images: bool = False) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test), one fixed split (seed 0) for every method and seed; standardised."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images if images else digits.data, dtype=torch.float32)
    x = x.unsqueeze(1) if images else x
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def minibatches(x: torch.Tensor, y: torch.Tensor, count: int, size: int, seed: int) -> list[Batch]:
    """``count`` mini-batches drawn epoch by epoch from a seeded permutation (last partial batch dropped)."""
    gen, order, out = torch.Generator().manual_seed(seed), torch.empty(0, dtype=torch.long), []
    for _ in range(count):
        if len(order) < size:
            order = torch.randperm(len(x), generator=gen)
        idx, order = order[:size], order[size:]
        out.append((x[idx], y[idx]))
    return out


def mlp_layers() -> list[sw.Layer]:
    widths = [64, 128, 128, 128]
    out: list[sw.Layer] = []
    for a, b in zip(widths, widths[1:], strict=False):
        out += [sw.Layer(nn.Linear, a, b), sw.Layer(nn.ReLU)]
    return out + [sw.Layer(nn.Linear, widths[-1], 10)]


class Stem(nn.Sequential):
    """The CNN's first layer: 3x3 convolution, GroupNorm, ReLU."""

    def __init__(self, width: int) -> None:
        super().__init__(nn.Conv2d(1, width, 3, 1, 1), nn.GroupNorm(8, width), nn.ReLU())


class PoolHead(nn.Module):
    """Global average pooling, then the classifier."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def cnn_layers(width: int = 16) -> list[sw.Layer]:
    return [
        sw.Layer(Stem, width),
        sw.Layer(ResBlock, width, width),
        sw.Layer(ResBlock, width, 2 * width, 2),
        sw.Layer(ResBlock, 2 * width, 2 * width),
        sw.Layer(PoolHead, 2 * width),
    ]


def _digits_workload(name: str, images: bool, layers: Callable[[], Any], lr: float, description: str) -> Workload:
    data: dict[str, tuple[torch.Tensor, ...]] = {}

    def get() -> tuple[torch.Tensor, ...]:
        if "d" not in data:
            data["d"] = load_digits(images=images)
        return data["d"]

    def train(count: int, size: int, seed: int) -> list[Batch]:
        x, y, _, _ = get()
        return minibatches(x, y, count, size, seed)

    def eval_sets(m: int) -> dict[str, Batch]:
        x, y, xt, yt = get()
        return {"train": _whole(x, y, m), "val": _whole(xt, yt, m)}

    return Workload(name, layers, F.cross_entropy, train, eval_sets, _accuracy, lr, 64, 0.3, description)


# ---- the stdlib-source GPT -----------------------------------------------------------------------

GPT_CONFIG = GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=2, n_layers=2)


class Embed(nn.Embedding):
    """Token embedding; the name only, so the layer list reads like the demo's."""


def gpt_layers(cfg: GPTConfig = GPT_CONFIG) -> dict[str, sw.Layer]:
    """The demo's GPT with an untied head (asynchronous schedules refuse tied modules)."""
    layers: dict[str, sw.Layer] = {
        "tokens": sw.Layer(Embed, cfg.vocab_size, cfg.d_model),
        "positions": sw.Layer(Positions, cfg),
    }
    layers.update({f"block{i}": sw.Layer(Block, cfg) for i in range(cfg.n_layers)})
    layers["ln_f"] = sw.Layer(nn.LayerNorm, cfg.d_model)
    layers["head"] = sw.Layer(nn.Linear, cfg.d_model, cfg.vocab_size, bias=False)
    return layers


def _gpt_workload(cfg: GPTConfig = GPT_CONFIG) -> Workload:
    data: dict[str, torch.Tensor] = {}

    def get() -> tuple[torch.Tensor, torch.Tensor]:
        if "train" not in data:
            data["train"], data["val"] = split(stdlib_corpus())
        return data["train"], data["val"]

    def train(count: int, size: int, seed: int) -> list[Batch]:
        stream = gpt_batches(get()[0], size, cfg.seq_len, seed)
        return [next(stream) for _ in range(count)]

    def eval_sets(m: int) -> dict[str, Batch]:
        tr, va = get()
        per = 128 // m * m  # 128 windows of 32 bytes each, 4 KiB per set
        (xt, yt), (xv, yv) = eval_batches(tr, per, cfg.seq_len, 1)[0], eval_batches(va, per, cfg.seq_len, 1)[0]
        return {"train": (xt, yt), "val": (xv, yv)}

    text = (
        f"byte-level GPT ({cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"{cfg.seq_len}-byte windows, untied head) on ~0.7 MB of stdlib source; train loss on 128 fixed training "
        "windows, val loss/accuracy (next byte) on 128 held-out windows"
    )
    return Workload("gpt", gpt_layers, _lm_loss, train, eval_sets, _accuracy, 0.5, 16, 3.0, text)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt": _gpt_workload,
    "cnn": lambda: _digits_workload(
        "cnn",
        True,
        cnn_layers,
        0.05,
        "digits CNN (stem + 3 residual blocks, width 16, GroupNorm) on sklearn's 8x8 digits; 1,500 train / 297 val",
    ),
    "mlp": lambda: _digits_workload(
        "mlp", False, mlp_layers, 0.05, "MLP 64-128-128-128-10 on sklearn's digits, flattened; 1,500 train / 297 val"
    ),
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"--workload: unknown {name!r}; expected one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]()
