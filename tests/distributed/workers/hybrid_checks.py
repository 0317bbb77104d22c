"""Hybrid-parallel checks (pp x dp x sharding x tp) on gloo: each runs on every rank of one torchrun job.

torchrun --standalone --nproc-per-node 8 tests/distributed/workers/worker.py --checks hybrid_checks \
    --suite hybrid8 --out DIR
(``--suite hybrid4`` on 4 processes: a quicker subset, for development.)

Every check builds its own mesh over the same processes, trains a tiny
float64 model against the one-process model and raises to fail; a check may
return numbers (measured memory), written next to its verdict as ``data``.
``suites(world)`` is pure, so the pytest side lists the same names without
starting processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl
from helpers.compare import ATOL, RTOL, assert_grads_close, assert_params_close
from stagewise.runtime.hybrid.tensor_parallel import full, local
from worker import Check, Ctx, raises

TIMEOUT = 60.0
D, HEAD_DIM, HEADS, VOCAB = mdl.D, 4, 4, mdl.VOCAB


# ---- a tiny tensor-parallel language model -------------------------------------
class TPBlock(nn.Module):
    """Pre-norm causal attention + MLP with separate q/k/v, so each can be split by output features.

    The heads are counted from the tensor (``q.shape[-1] // head_dim``): under
    tensor parallelism a rank holds ``HEADS / tp`` of them.
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D, dtype=dtype)
        self.q = nn.Linear(D, HEADS * HEAD_DIM, dtype=dtype)
        self.k = nn.Linear(D, HEADS * HEAD_DIM, dtype=dtype)
        self.v = nn.Linear(D, HEADS * HEAD_DIM, dtype=dtype)
        self.proj = nn.Linear(HEADS * HEAD_DIM, D, dtype=dtype)
        self.ln2 = nn.LayerNorm(D, dtype=dtype)
        self.fc = nn.Linear(D, 2 * D, dtype=dtype)
        self.out = nn.Linear(2 * D, D, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, HEAD_DIM).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


Head = mdl.Head  # the runtime tests' LM head: same D and VOCAB


def tp_lm(blocks: int = 4) -> list[sw.Layer]:
    return (
        [sw.Layer(nn.Embedding, VOCAB, D, dtype=torch.float64)]
        + [sw.Layer(TPBlock) for _ in range(blocks)]
        + [sw.Layer(Head)]
    )


def tp_plan() -> dict[str, Any]:
    column, row = sw.runtime.column_parallel, sw.runtime.row_parallel
    return {
        "0": sw.runtime.vocab_parallel_embedding(),
        "*.q": column(),
        "*.k": column(),
        "*.v": column(),
        "*.proj": row(),
        "*.fc": column(),
        "*.out": row(),
        "*.lm": column(gather_output=True),
    }


def tied_lm(blocks: int = 5) -> list[sw.Layer]:
    """A tp_lm whose embedding is tied to the head (GPT-2's weight tying); 8 layers, enough for 4 ranks x 2."""
    return [
        sw.Tied("embed", sw.Layer(nn.Embedding, VOCAB, D, dtype=torch.float64)),
        *[sw.Layer(TPBlock) for _ in range(blocks)],
        sw.Layer(nn.LayerNorm, D, dtype=torch.float64),
        sw.Tied("embed", forward_fn=_tied_head),
    ]


def _tied_head(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.T


def tied_plan() -> dict[str, Any]:
    """The blocks split as in tp_plan; the tied embedding / head stay whole."""
    return {k: v for k, v in tp_plan().items() if k not in ("0", "*.lm")}


# ---- checks ----------------------------------------------------------------------
def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (its local shards; the scalar step counters left out)."""
    return sum(
        local(v).numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _model(model: str) -> tuple[list[sw.Layer], Any, Any, dict[str, Any]]:
    """Layers, loss, data and tensor-parallel plan of a test model."""
    if model == "lm":
        return tp_lm(), mdl.lm_loss, mdl.lm_data, tp_plan()
    if model == "tied":
        return tied_lm(), mdl.lm_loss, mdl.lm_data, tied_plan()
    return mdl.mlp(), F.cross_entropy, mdl.mlp_data, tp_plan()


def parity(config: sw.ParallelConfig, schedule: str, m: int, model: str = "lm", clip: float = 0.05) -> Check:
    """Two AdamW steps against the one-process model: global loss, every gradient (whole, gathered over
    sharding and tp), the clipped norm and the parameters after each step; returns optimizer-state bytes."""

    def check(ctx: Ctx) -> dict[str, Any]:
        layers, loss_fn, data, plan = _model(model)
        pipe = sw.Pipeline(
            layers,
            loss_fn=loss_fn,
            schedule=schedule,
            microbatches=m,
            parallel=config,
            tp_plan=plan,
            seed=7,
            timeout=TIMEOUT,
        )
        ref = sw.build_model(layers, seed=7)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(2):
            x, y = data(config.replicas * (m + 1), 100 + step)  # m + 1 per replica: uneven micro-batches
            loss = pipe.train_step(*pipe.local_batch(x, y))
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) <= 1e-10 * (1 + abs(ref_loss.item())), (step, loss, ref_loss.item())
            assert_grads_close(pipe, ref, f"step {step}")
            norm = pipe.clip_grad_norm_(clip)
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            assert abs(norm - ref_norm) <= 1e-10 * ref_norm, (step, norm, ref_norm)
            assert_grads_close(pipe, ref, f"step {step}, clipped")
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            assert_params_close(pipe, ref, f"after step {step}")
        local_params = sum(local(p).numel() for p in pipe.parameters())
        return {
            "coords": list(pipe.hybrid.mesh.coords),
            "state_bytes": _state_bytes(opt),
            "ref_state_bytes": _state_bytes(ref_opt),
            "param_numel": local_params,
        }

    return check


def factory_and_eval(config: sw.ParallelConfig) -> Check:
    """optimizer= steps each stage inside the schedule, on its shard, after its gradients are reduced; eval_step
    gathers (and reshards); checkpoint names are the one-process model's, split over pp, equal when gathered."""

    def check(ctx: Ctx) -> None:
        _factory_and_eval(config)

    return check


def _factory_and_eval(config: sw.ParallelConfig) -> None:
    layers = tp_lm()
    pipe = sw.Pipeline(
        layers,
        loss_fn=mdl.lm_loss,
        schedule="zb-h1",
        microbatches=2,
        parallel=config,
        tp_plan=tp_plan(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        seed=3,
        timeout=TIMEOUT,
    )
    ref = sw.build_model(layers, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = mdl.lm_data(2 * config.replicas, seed=step)
        pipe.train_step(*pipe.local_batch(x, y))
        ref_opt.zero_grad()
        mdl.lm_loss(ref(x), y).backward()
        ref_opt.step()
        assert_params_close(pipe, ref, f"after step {step}")
        out = pipe.eval_step(x)
        if pipe.rank == pipe.schedule.placement[-1]:
            torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
    keys = list(pipe.state_dict())
    pp_keys = [None] * config.world_size
    torch.distributed.all_gather_object(pp_keys, keys)
    flat = {k for ks in pp_keys for k in ks}
    assert flat == set(ref.state_dict()), sorted(flat ^ set(ref.state_dict()))
    refs = ref.state_dict()
    for k, v in pipe.state_dict().items():
        torch.testing.assert_close(full(v), refs[k], rtol=RTOL, atol=ATOL)


def invalid(ctx: Ctx) -> None:
    """Clear errors before anything can hang: a wrong product, group= with parallel=, tp without a plan."""

    raises(
        ValueError,
        f"pp=3 x dp=1 x sharding=1 x tp=1 = 3 processes, but the world has {ctx.world}",
        lambda: sw.Pipeline(mdl.mlp(), parallel=sw.ParallelConfig(pp=3)),
    )
    world = torch.distributed.group.WORLD
    raises(
        ValueError,
        "either group= or parallel=",
        lambda: sw.Pipeline(mdl.mlp(), group=world, parallel=sw.ParallelConfig()),
    )
    mesh = sw.runtime.build_mesh(sw.ParallelConfig(pp=2, tp=ctx.world // 2))
    raises(ValueError, "needs a tp_plan=", lambda: sw.Pipeline(mdl.mlp(), parallel=mesh, timeout=TIMEOUT))
    raises(
        ValueError,  # on every rank alike, those without the embedding too
        "tp_plan keys ['0'] split layer '0', a use of tied key 'embed': tied modules stay whole",
        lambda: sw.Pipeline(tied_lm(), parallel=mesh, tp_plan=tp_plan(), timeout=TIMEOUT),
    )
    raises(
        ValueError,
        "tp_plan keys ['7*'] split layer '7', a use of tied key 'embed'",  # the head's use, by a pattern
        lambda: sw.Pipeline(tied_lm(), parallel=mesh, tp_plan={"7*": sw.runtime.column_parallel()}, timeout=TIMEOUT),
    )
    config = sw.ParallelConfig(pp=2, dp=ctx.world // 2)
    pipe = sw.Pipeline(mdl.mlp(), loss_fn=F.cross_entropy, parallel=config)
    raises(ValueError, "does not split evenly", lambda: pipe.local_batch(*mdl.mlp_data(ctx.world // 2 + 1, seed=0)))
    pp = config.coords(ctx.rank).pp  # the pipeline rank, shared by the dp replicas; the process rank is not
    assert (pipe.pp_rank, pipe.rank, pipe.process_rank, pipe.num_ranks) == (pp, pp, ctx.rank, 2), ctx.rank


def clip_pp_only(ctx: Ctx) -> None:
    """Without parallel=: clip_grad_norm_ sums over the pipeline group's stages, as the one-process model."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="1f1b", microbatches=2, seed=1, timeout=TIMEOUT)
    ref = sw.build_model(layers, seed=1)
    x, y = mdl.mlp_data(5, seed=0)
    pipe.train_step(x, y)
    F.cross_entropy(ref(x), y).backward()
    for norm_type in (2.0, float("inf"), 1.0):
        norm = pipe.clip_grad_norm_(0.01, norm_type)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type))
        assert abs(norm - ref_norm) <= 1e-10 * ref_norm, (norm_type, norm, ref_norm)
        assert_grads_close(pipe, ref, f"clipped in the {norm_type}-norm")


def _inf_where_marked(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, plus an infinity (a constant: no gradient) where a target is marked -100, which
    cross-entropy ignores: a non-finite loss whose gradients stay finite, so only the check can stop it."""
    marked = (y == -100).any()
    return F.cross_entropy(logits, y) + torch.where(marked, float("inf"), 0.0).to(logits.dtype)


def nan_in_one_replica(ctx: Ctx) -> None:
    """pp 2 x dp 4: the last replica's loss is infinite and every gradient finite, so the data-parallel reduction
    of the gradients spreads nothing. The check reduces its flag over the pipeline's group and then the
    replicas, so every rank of every replica refuses the step ("raise") or drops its gradients and counts the
    skip ("skip"), and no stage's optimizer (stepped inside the schedule) moved a weight: they stay the
    one-process model's."""
    config = sw.ParallelConfig(pp=2, dp=ctx.world // 2)
    x, y = mdl.mlp_data(4 * config.replicas, seed=3)
    y[-1] = -100  # the last replica's rows only
    ref = sw.build_model(mdl.mlp(), seed=5)
    for policy in ("raise", "skip"):
        pipe = sw.Pipeline(
            mdl.mlp(), loss_fn=_inf_where_marked, schedule="1f1b", microbatches=2, parallel=config, seed=5,
            timeout=TIMEOUT, nan_policy=policy, optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        )  # fmt: skip
        batch = pipe.local_batch(x, y)
        marked = bool((batch[1] == -100).any())
        assert marked == (pipe.hybrid.mesh.replica == config.replicas - 1), (ctx.rank, pipe.hybrid.mesh.replica)
        if policy == "raise":
            try:
                pipe.train_step(*batch)
            except sw.PipelineError as err:
                assert "non-finite values in the train step: stage 1's loss for micro-batch 1 is inf" in str(err), err
            else:
                raise AssertionError(f"rank {ctx.rank} (marked batch: {marked}) trained through an infinite loss")
        else:
            pipe.train_step(*batch)
            assert pipe.skipped_steps == 1, (ctx.rank, pipe.skipped_steps)
            assert all(p.grad is None for p in pipe.parameters()), f"rank {ctx.rank} kept the step's gradients"
        assert_params_close(pipe, ref, f"after a {policy!r} step with an infinite loss in one replica")


def layouts8() -> dict[str, Check]:
    P = sw.ParallelConfig
    return {
        # 2 x 2 x 2: pp x sharding x tp (ZeRO-sharded stages of split layers), and pp x dp x tp with I/W split
        "pp2-sharding2-tp2-1f1b": parity(P(pp=2, sharding=2, tp=2), "1f1b", 3),
        "pp2-dp2-tp2-zb-h1": parity(P(pp=2, dp=2, tp=2), "zb-h1", 2),
        # 1 x 2 x 4: one stage; sharding x tp4, and Paddle's sharding-DP (dp 2 x sharding 4, HSDP)
        "pp1-sharding2-tp4-gpipe": parity(P(sharding=2, tp=4), "gpipe", 2),
        "pp1-dp2-sharding4-gpipe": parity(P(dp=2, sharding=4), "gpipe", 2, model="mlp"),
        # 4 x 2 x 1: a deep pipeline on V schedules (two stages per rank), replicated or sharded
        "pp4-dp2-zb-v": parity(P(pp=4, dp=2), "zb-v", 4, model="mlp"),
        "pp4-sharding2-dualpipe-v": parity(P(pp=4, sharding=2), "dualpipe-v", 4, model="mlp"),
        # tied embedding / head across the pipeline, whole on every other axis; on V both uses share rank 0
        "tied-pp2-dp2-tp2-1f1b": parity(P(pp=2, dp=2, tp=2), "1f1b", 3, model="tied"),
        "tied-pp2-sharding2-tp2-zb-h1": parity(P(pp=2, sharding=2, tp=2), "zb-h1", 2, model="tied"),
        "tied-pp4-dp2-zb-v": parity(P(pp=4, dp=2), "zb-v", 4, model="tied"),
        "factory-eval-names-dp": factory_and_eval(P(pp=2, dp=2, tp=2)),
        "factory-eval-names-sharding": factory_and_eval(P(pp=2, sharding=2, tp=2)),
        "clip-pp-only": clip_pp_only,
        "nan-in-one-replica": nan_in_one_replica,
        "invalid": invalid,
    }


def layouts4() -> dict[str, Check]:
    P = sw.ParallelConfig
    return {
        "pp2-sharding2-1f1b": parity(P(pp=2, sharding=2), "1f1b", 2),
        "pp2-tp2-zb-h1": parity(P(pp=2, tp=2), "zb-h1", 2),
        "pp1-dp2-tp2-gpipe": parity(P(dp=2, tp=2), "gpipe", 2),
        "tied-pp2-dp2-1f1b": parity(P(pp=2, dp=2), "1f1b", 2, model="tied"),
    }


SUITES: dict[str, Callable[[], dict[str, Check]]] = {"hybrid8": layouts8, "hybrid4": layouts4}


def checks(world: int, suite: str) -> dict[str, Check]:
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return SUITES[suite]()
