"""A small residual CNN on scikit-learn's bundled handwritten digits, pipelined over 2 processes.

    stagewise run -n 2 examples/digits_cnn.py --out out/digits

The data ships with scikit-learn (1,797 greyscale 8x8 images, 10 classes; no
download). The model is an ordinary ``nn.Module``, a ResNet in miniature,
whose parts are built inside ``with sw.stage(k):`` blocks; ``Pipeline.from_model``
traces it and cuts it at those tags, and each rank keeps its own stage.
To adapt it to your model: wrap the construction of your model's parts in
``with sw.stage(k):``, pick ``--microbatches``, and keep the loop as it is.

GroupNorm rather than BatchNorm: a pipeline runs each micro-batch on its own,
so BatchNorm would normalise over micro-batches, not the whole batch, and the
pipelined model would differ from the one-process one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from reporting import TrainingProgress, console, summary_table
from stagewise.runtime import gather_state_dict, plot_losses


class ResBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.skip(x))


class DigitsNet(nn.Module):
    """Stem, three residual blocks (8x8 -> 4x4), pooling and a classifier; two pipeline stages."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        with sw.stage(0):
            self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1), nn.GroupNorm(8, width), nn.ReLU())
            self.block1 = ResBlock(width, width)
            self.block2 = ResBlock(width, 2 * width, stride=2)
        with sw.stage(1):
            self.block3 = ResBlock(2 * width, 2 * width)
            self.fc = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block3(self.block2(self.block1(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))


def load_digits(seed: int = 0, test_size: int = 297) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): images as (N, 1, 8, 8), standardised with the training set's mean and std."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    test, train = order[:test_size], order[test_size:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/digits"), help="output folder (default out/digits)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    p.add_argument("--batch-size", type=int, default=64, help="images per step (default 64)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (default 1f1b; see `stagewise schedules`)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of AdamW (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the data split and the batches (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines")
    args = p.parse_args(argv)

    started = time.perf_counter()
    sw.init()  # joins the group torchrun describes (one process without it)
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    torch.manual_seed(args.seed)  # every rank builds the same model, then keeps its own stage of it
    pipe = sw.Pipeline.from_model(
        DigitsNet(),
        loss_fn=F.cross_entropy,
        schedule=args.schedule,
        microbatches=args.microbatches,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
    )
    reporter = pipe.schedule.placement[-1]  # the rank with the last stage has the loss and the logits
    reports = pipe.rank == reporter
    if reports:
        args.out.mkdir(parents=True, exist_ok=True)
        console.print(f"[bold]stagewise[/bold]: digits CNN, {pipe.num_ranks} stages, {len(x_train)} training images")

    progress = TrainingProgress(args.steps, unit="images/s", enabled=reports and not args.no_progress, log_every=25)
    gen = torch.Generator().manual_seed(args.seed)  # same seed on every rank: same batches everywhere
    order, losses, accuracy, bubble = torch.empty(0, dtype=torch.long), [], [], None
    for step in range(1, args.steps + 1):
        if len(order) < args.batch_size:  # a new epoch; the last partial batch is dropped
            order = torch.randperm(len(x_train), generator=gen)
        idx, order = order[: args.batch_size], order[args.batch_size :]
        t0 = time.perf_counter()
        loss = pipe.train_step(x_train[idx], y_train[idx])
        rate = args.batch_size / (time.perf_counter() - t0)
        losses.append((step, loss))
        if step % 10 == 0:  # the measured idle share of the last step, gathered from every rank
            bubble = pipe.timeline(gather=True).bubble_ratio
        progress.update(step, loss, rate, bubble)
        if step % 25 == 0 or step == args.steps:
            logits = pipe.eval_step(x_test)  # None except on the last stage's rank
            if reports:
                accuracy.append((step, float((logits.argmax(1) == y_test).float().mean())))
    progress.close()

    state = gather_state_dict(pipe, dst=reporter)  # a collective: every rank takes part
    if reports:
        torch.save({"model": state, "seed": args.seed}, args.out / "checkpoint.pt")
        plot_losses(losses, [], args.out / "loss_curve.png", title="digits CNN, training loss")
        first = statistics.fmean(v for _, v in losses[:10])
        last = statistics.fmean(v for _, v in losses[-10:])
        summary = {"first_loss": first, "final_loss": last, "test_accuracy": accuracy[-1][1]}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        summary_table(
            "stagewise: digits CNN",
            [
                ("loss", f"{first:.3f} -> {last:.3f} (means of the first and last 10 steps)"),
                ("test accuracy", f"{accuracy[-1][1]:.1%} on {len(x_test)} images"),
                ("time", f"{time.perf_counter() - started:.1f} s for {args.steps} steps"),
                ("outputs", str(args.out)),
            ],
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
