"""A GPT trained with 4-D hybrid parallelism: pipeline x data x ZeRO sharding x tensor parallel.

    stagewise run -n 8 examples/hybrid_tp_pp.py --pp 2 --sharding 2 --tp 2
    stagewise run -n 8 examples/hybrid_tp_pp.py --pp 2 --dp 2 --tp 2 --schedule zb-h1
    stagewise run -n 8 examples/hybrid_tp_pp.py --dp 2 --sharding 4          # Paddle's sharding-DP

The degrees multiply to the number of processes. The mesh is laid out
``(pp, dp, sharding, tp)``, tensor parallel innermost (neighbouring ranks:
the same machine), the pipeline outermost. Each stage's blocks are split
Megatron-style by the plan in :func:`tp_plan`: q, k, v and the first MLP
layer by output features (column-parallel), the attention projection and the
second MLP layer by input features (row-parallel), the token embedding by
vocabulary. A rank then holds ``n_heads / tp`` heads, which :class:`TPBlock`
counts from its tensors.

The model learns a fixed random walk over the vocabulary (each token has one
likely successor), so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from gpt_model import GPTConfig

log = logging.getLogger("hybrid_tp_pp")


class Embedding(nn.Module):
    """Token plus learned position embedding (the tokens split by vocabulary under tensor parallelism)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tokens(idx) + self.positions(pos)


class TPBlock(nn.Module):
    """Pre-norm causal attention and MLP, written so that tensor parallelism can split it.

    q, k and v are separate layers (a fused qkv split by output features would
    hand a rank parts of q and k), and the number of heads is read from the
    tensor: under ``tp`` ranks each holds ``n_heads / tp`` of them.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TPHead(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def tp_gpt_layers(cfg: GPTConfig) -> list[sw.Layer]:
    """Embedding, ``n_layers`` blocks, head: ``n_layers + 2`` lazily built layers named ``"0"``..."""
    return [sw.Layer(Embedding, cfg)] + [sw.Layer(TPBlock, cfg) for _ in range(cfg.n_layers)] + [sw.Layer(TPHead, cfg)]


def tp_plan() -> dict:
    """Which modules tensor parallelism splits, by name in the one-process model (``*`` matches any prefix)."""
    column, row = sw.runtime.column_parallel, sw.runtime.row_parallel
    return {
        "0.tokens": sw.runtime.vocab_parallel_embedding(),
        "*.q": column(),
        "*.k": column(),
        "*.v": column(),
        "*.proj": row(),
        "*.fc": column(),
        "*.out": row(),
        "*.lm": column(gather_output=True),  # whole logits for the loss on every tp rank
    }


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def random_walk(batch: int, cfg: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where token ``i`` is followed by ``succ[i]`` 90% of the time (the same walk on every rank)."""
    succ = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(batch, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
    for t in range(cfg.seq_len):
        noise = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        keep = torch.rand(batch, generator=g) < 0.9
        tokens[:, t + 1] = torch.where(keep, succ[tokens[:, t]], noise)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    axes = {"pp": "pipeline", "dp": "data-parallel", "sharding": "ZeRO sharding (FSDP2)", "tp": "tensor-parallel"}
    for axis, what in axes.items():
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{what} degree (default 1)")
    parser.add_argument(
        "--schedule", default="1f1b", help="pipeline schedule (default 1f1b; see `stagewise schedules`)"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, cut over dp x sharding")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads, a multiple of --tp (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of AdamW (default 3e-3)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    sw.init()
    config = sw.ParallelConfig(pp=args.pp, dp=args.dp, sharding=args.sharding, tp=args.tp)
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers)
    pipe = sw.Pipeline(
        tp_gpt_layers(cfg),
        loss_fn=lm_loss,
        schedule=args.schedule,
        microbatches=args.microbatches,
        parallel=config,  # builds the (pp, dp, sharding, tp) mesh; the schedule runs on the pp group
        tp_plan=tp_plan(),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)  # this rank's shards only
    mesh = pipe.hybrid.mesh
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = random_walk(args.batch_size, cfg, step)
        loss = pipe.train_step(*pipe.local_batch(x, y))  # the global batch's mean loss, on every rank
        norm = pipe.clip_grad_norm_(1.0)  # over every stage and every axis
        optimizer.step()
        optimizer.zero_grad()
        if mesh.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            log.info("step %3d  loss %.3f  grad norm %.3f", step + 1, loss, norm)  # (1-based, as the progress line)
    state = sum(
        v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    log.info(
        "rank %d at %s: stages %s, %.1f s, optimizer state %.1f KiB",
        mesh.rank,
        dict(mesh.coords._asdict()),
        list(pipe.local_stages),
        time.perf_counter() - started,
        state / 1024,
    )


if __name__ == "__main__":
    main()
