"""Checks for ``Pipeline.from_hf`` (issues 15 and 31), run on every rank of one torchrun job.

    torchrun --standalone --nproc-per-node 2 tests/distributed/workers/worker.py --checks hf_checks --out DIR

The families of :mod:`helpers.hf_families` (tiny, random-init, float64). A parity check trains two steps on a
right-padded batch (labels -100 at the padding and elsewhere, uneven micro-batches, uneven token counts) and
compares the loss with the float64 loss of ``model(..., use_cache=False)``'s logits (to 1e-12; and with
transformers' own float32 loss to float32 rounding), every gradient with the model's (to 1e-10 relative), the
evaluation logits and the state-dict keys; it returns the errors it measured. ``checks(world)`` is what CI
runs: every family once at 2 ranks, the parallel axes and the checkpoint at 4; ``checks(world, "grid")`` is
the whole grid of ``make hf-grid`` (every family x 1f1b and zb-v x tied and untied, 2 and 4 ranks).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import day_two_checks
import stagewise as sw
from helpers.compare import assert_grads_close
from helpers.hf_families import (
    FAMILIES,
    FLOAT32_NORMS,
    V,
    build,
    is_tied,
    packed_positions,
    padded_batch,
    with_dropout,
)
from stagewise.runtime.hybrid.tensor_parallel import full
from worker import Check, Ctx, gather_objects, raises

TIMEOUT = 90.0
LOSS_TOL, GRAD_TOL = 1e-12, 1e-10
WHOLE_TOL = 1e-5  # FLOAT32_NORMS families against the whole batch: float32 sums of their norms' gradients


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss written out: position t predicts labels[t + 1]; mean over non-ignored tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)


def references(ref: nn.Module, kwargs: dict[str, Any], labels: torch.Tensor, m: int) -> dict[str, Any]:
    """The one-process model's loss (float64 from its logits, and transformers' own, float32) and gradients: on the
    whole batch, and on the pipeline's ``m`` micro-batches (each weighted by its share of the counted tokens).

    Gemma 1-3 and Cohere compute their norms in float32 inside a float64 model, so a norm weight's gradient is a
    float32 sum over the batch's tokens: summed per micro-batch it differs from the whole batch's by float32
    rounding, whoever runs it. The micro-batched reference has the pipeline's sums; the whole batch is the model.
    """
    ref.zero_grad(set_to_none=True)
    out = ref(**kwargs, labels=labels, use_cache=False)
    loss = reference_loss(out.logits, labels)
    loss.backward()
    whole = _grads(ref)
    ref.zero_grad(set_to_none=True)
    counts = [(y[:, 1:] != -100).sum() for y in labels.tensor_split(m)]
    for k in range(m):
        chunk = {key: v.tensor_split(m)[k] for key, v in kwargs.items()}
        y = labels.tensor_split(m)[k]
        (reference_loss(ref(**chunk, use_cache=False).logits, y) * counts[k] / sum(counts)).backward()
    return {"loss": loss.item(), "hf_loss": out.loss.item(), "whole": whole, "micro": _grads(ref)}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def grad_error(pipe: Any, grads: dict[str, torch.Tensor], what: str, elementwise: bool = True) -> float:
    """The largest gradient error of this rank's parameters, each relative to its largest entry (at least a
    millionth of the largest of any: a gradient that is zero but for rounding, a key bias's, is not scaled up).
    ``elementwise``: each entry must also be within 1e-10 relative plus 1e-12 (raises)."""
    top = max(float(g.abs().max()) for g in grads.values())
    worst = 0.0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{what}: {name} got no gradient"
        got, want = full(p.grad), grads[name]
        if elementwise:
            msg = lambda m, n=name: f"{what} {n}: {m}"  # noqa: E731
            torch.testing.assert_close(got, want, rtol=GRAD_TOL, atol=LOSS_TOL, msg=msg)
        worst = max(worst, float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6 * top))
    return worst


# ---- parity -------------------------------------------------------------------------------------
def parity(
    family: str,
    schedule: str,
    m: int,
    layers: int,
    *,
    tied: bool | None = None,
    inputs: str = "right",
    **options: Any,
) -> Check:
    """Two train steps and an eval step against a deep copy in one process; names and state-dict keys.

    ``inputs``: ``"right"`` / ``"left"`` padding, ``"dict"`` (as a tokenizer gives them), ``"packed"`` (no mask,
    positions restarting per document).
    """

    def check(ctx: Ctx) -> dict[str, Any]:
        model = build(family, layers, tied)
        ref = copy.deepcopy(model)
        pipe = sw.Pipeline.from_hf(
            model, schedule=schedule, microbatches=m, group=ctx.group, timeout=TIMEOUT, **options
        )
        errors = {"loss_err": 0.0, "grad_err": 0.0, "whole_batch_grad_err": 0.0}
        for step in range(2):  # (asserted after both steps: a rank failing early would leave the other waiting)
            args, kwargs, labels = _batch(2 * m + 1, step, inputs)
            pipe.zero_grad(set_to_none=True)
            loss = pipe.train_step(args, labels)
            want = references(ref, kwargs, labels, m)
            hf_err = abs(loss - want["hf_loss"]) / (4 * torch.finfo(torch.float32).eps * abs(want["hf_loss"]))
            errors["loss_err"] = max(errors["loss_err"], abs(loss - want["loss"]), LOSS_TOL * (hf_err > 1))
            errors["grad_err"] = max(errors["grad_err"], grad_error(pipe, want["micro"], f"step {step}", False))
            whole = grad_error(pipe, want["whole"], f"step {step}, whole batch", False)
            errors["whole_batch_grad_err"] = max(errors["whole_batch_grad_err"], whole)
        assert errors["loss_err"] <= LOSS_TOL, errors
        assert errors["grad_err"] <= GRAD_TOL, errors
        assert errors["whole_batch_grad_err"] <= (WHOLE_TOL if family in FLOAT32_NORMS else GRAD_TOL), errors
        grad_error(pipe, want["micro"], "step 1", elementwise=True)
        logits = pipe.eval_step(args)
        if pipe.rank == pipe.schedule.placement[-1]:
            with torch.no_grad():
                expected = ref(**kwargs, use_cache=False).logits
            torch.testing.assert_close(logits, expected, rtol=GRAD_TOL, atol=LOSS_TOL)
        keys = [k for ks in gather_objects(list(pipe.state_dict()), ctx.group) for k in ks]
        assert sorted(set(keys)) == sorted(ref.state_dict()), sorted(set(keys) ^ set(ref.state_dict()))
        # named_parameters lists what one process lists (a tied head held without the embedding under the
        # embedding's name: an optimizer grouped by name treated the copies apart, and they drifted, 2026-12-06)
        listed, one = {n for n, _ in pipe.named_parameters()}, dict(ref.named_parameters())
        assert listed <= one.keys(), sorted(listed - one.keys())
        assert len(keys) == len(set(keys)), "a state-dict key saved on two ranks"
        stages = [len(r) for r in pipe.layer_ranges]
        return {"family": family, "schedule": schedule, "tied": is_tied(ref), **errors, "layers per stage": stages}

    return check


def _batch(rows: int, seed: int, inputs: str) -> tuple[Any, dict[str, Any], torch.Tensor]:
    """The pipeline's inputs, the reference's keyword arguments, the labels."""
    (ids, mask), labels = padded_batch(rows, seed, left=inputs == "left")
    if inputs == "packed":
        positions = packed_positions(rows, seed)
        labels = labels.masked_fill(positions == 0, -100)  # no document predicts the next one's first token
        return (ids, None, positions), {"input_ids": ids, "position_ids": positions}, labels
    kwargs = {"input_ids": ids, "attention_mask": mask}
    return (kwargs if inputs == "dict" else (ids, mask)), kwargs, labels


# ---- the parallel axes, the checkpoint ----------------------------------------------------------
def hybrid(family: str, axis: str, tied: bool | None = None) -> Check:
    """pp=2 x ``axis``=2 on 4 ranks, each replica on its share of a global batch: loss and gradients equal the
    one-process model's on the whole batch (tp: the plan is the config's own ``base_model_tp_plan``)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        model = build(family, 4, tied)
        assert tied is None or is_tied(model) == tied, (family, tied)
        ref = copy.deepcopy(model)
        parallel = sw.ParallelConfig(pp=2, **{axis: 2})
        pipe = sw.Pipeline.from_hf(model, parallel=parallel, schedule="1f1b", microbatches=2, timeout=TIMEOUT)
        (ids, mask), labels = padded_batch(8, seed=3)
        x, y = pipe.local_batch((ids, mask), labels)
        loss = pipe.train_step(x, y)
        ref_loss = reference_loss(ref(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= LOSS_TOL, (loss, ref_loss.item())
        err = grad_error(pipe, _grads(ref), f"pp x {axis}")
        assert err <= GRAD_TOL, err
        return {"family": family, "schedule": f"1f1b, pp=2 x {axis}=2", "tied": is_tied(ref),
                "loss_err": abs(loss - ref_loss.item()), "grad_err": err, "whole_batch_grad_err": err}  # fmt: skip

    return check


def planned(family: str) -> Check:
    """Issue 51 item 1: ``sw.profile`` of the model (per decoder layer), ``sw.plan`` for the job's processes (rank 0's
    profile for all), the top plan built by ``Pipeline.from_plan(plan, model)``: one step equals the one-process
    model on the whole batch."""

    def check(ctx: Ctx) -> dict[str, Any]:
        model = build(family, 4)
        ref = copy.deepcopy(model)
        prof = sw.profile(model, padded_batch(2, seed=0)[0])
        assert len(prof.layers) == 4, [c.name for c in prof.layers]
        plans = sw.plan(prof, ctx.world, global_batch=8, top=20)
        top = plans[0]  # (for tied GPT-2, sharding=4 here: built and trained exactly since the tie is ignored by FSDP)
        pipe = sw.Pipeline.from_plan(top, model, timeout=TIMEOUT)
        (ids, mask), labels = padded_batch(8, seed=3)
        loss = pipe.train_step(*pipe.local_batch((ids, mask), labels))
        ref_loss = reference_loss(ref(input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= LOSS_TOL, (top.describe(), loss, ref_loss.item())
        err = grad_error(pipe, _grads(ref), f"plan {top.describe()}")
        assert err <= GRAD_TOL, err
        return {"family": family, "schedule": f"the top plan: {top.describe()}", "tied": is_tied(ref),
                "sharding": top.layout.sharding,
                "loss_err": abs(loss - ref_loss.item()), "grad_err": err, "whole_batch_grad_err": err}  # fmt: skip

    return check


def checkpoint_every_replica(ctx: Ctx) -> dict[str, Any]:
    """pp=2 x dp=2: every rank calls save; each tensor is written once (by one rank) and loads back into a
    pipeline of a differently initialised model; a second save while the first one's folder exists does not
    hang either."""
    from stagewise.runtime.checkpoint.dcp_files import SafeReader

    folder = Path(gather_objects(tempfile.mkdtemp() if ctx.rank == 0 else None, None)[0])
    try:
        parallel = sw.ParallelConfig(pp=2, dp=2)
        pipe = sw.Pipeline.from_hf(build("llama", 4, tied=True), parallel=parallel, timeout=TIMEOUT)
        (ids, mask), labels = padded_batch(8, seed=4)
        pipe.train_step(*pipe.local_batch((ids, mask), labels))
        saved = sw.checkpoint.save(folder, pipe, step=1)
        sw.checkpoint.save(folder, pipe, step=2)
        meta = SafeReader(str(saved)).read_metadata()
        writers: dict[str, set[str]] = {}
        for index, info in meta.storage_data.items():
            writers.setdefault(index.fqn, set()).add(info.relative_path)
        model_keys = {k for k in writers if k.startswith("model")}
        assert all(len(files) == 1 for files in writers.values()), writers
        other = sw.Pipeline.from_hf(build("llama", 4, tied=True, seed=1), parallel=parallel, timeout=TIMEOUT)
        sw.checkpoint.load(saved, other)
        mine = dict(pipe.named_parameters())
        for name, p in other.named_parameters():
            torch.testing.assert_close(p, mine[name], rtol=0, atol=0)
        return {"tensors": len(model_keys), "files": sorted({f for fs in writers.values() for f in fs})}
    finally:
        gather_objects(None, None)  # every rank is done with the folder
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


# ---- dropout --------------------------------------------------------------------------------------
def dropout(schedule: str, m: int) -> Check:
    """GPT-BigCode at its default dropouts (0.1 each), trained two steps: the loss and every gradient equal the
    one-process model's drawing the same masks micro-batch by micro-batch (``sw.runtime.seeded_dropout``); the
    masks matter (without them the loss is another)."""

    def check(ctx: Ctx) -> dict[str, Any]:
        model = with_dropout(layers=2 * ctx.world)
        ref = copy.deepcopy(model)
        pipe = sw.Pipeline.from_hf(
            model, schedule=schedule, microbatches=m, group=ctx.group, timeout=TIMEOUT, dropout_seed=7
        )
        gaps = []
        for step in range(2):
            args, kwargs, labels = _batch(2 * m + 1, step, "right")
            pipe.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = pipe.train_step(args, labels)
            counts = [(y[:, 1:] != -100).sum() for y in labels.tensor_split(m)]
            want = 0.0
            for k in range(m):
                chunk = {key: v.tensor_split(m)[k] for key, v in kwargs.items()}
                with sw.runtime.seeded_dropout(ref, seed=7, step=step, microbatch=k):
                    logits = ref(**chunk, use_cache=False).logits
                part = reference_loss(logits, labels.tensor_split(m)[k]) * counts[k] / sum(counts)
                part.backward()
                want += float(part.detach())
            assert abs(loss - want) <= LOSS_TOL, (step, loss, want)
            grad_error(pipe, _grads(ref), f"dropout step {step}")
            with torch.no_grad():
                plain = reference_loss(ref.eval()(**kwargs, use_cache=False).logits, labels)
            ref.train()
            gaps.append(abs(loss - float(plain)))
        assert min(gaps) > 1e-3, f"dropout changed nothing: the check would not see wrong masks ({gaps})"
        return {"loss gap to no dropout": gaps}

    return check


# ---- options and refusals -----------------------------------------------------------------------
def uneven_tokens(ctx: Ctx) -> None:
    """Micro-batches with very different token counts (one with none): weighting by rows would be wrong."""
    m = 3
    model = build("llama", 2 * ctx.world)
    ref = copy.deepcopy(model)
    pipe = sw.Pipeline.from_hf(model, schedule="1f1b", microbatches=m, group=ctx.group, timeout=TIMEOUT)
    (ids, mask), labels = padded_batch(6, seed=7)
    labels[2:4] = -100  # micro-batch 1 counts no token
    labels[4:, 1:] = ids[4:, 1:]  # micro-batch 2 counts every token
    loss = pipe.train_step((ids, mask), labels)
    ref_loss = reference_loss(ref(input_ids=ids, attention_mask=mask).logits, labels)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= LOSS_TOL, (loss, ref_loss.item())
    assert_grads_close(pipe, ref, "uneven tokens", aliases=True)
    rows = sw.Pipeline.from_hf(  # the same loss weighted by rows, not tokens: another (wrong) number
        build("llama", 2 * ctx.world), schedule="1f1b", microbatches=m, group=ctx.group, loss_weights=None
    )
    by_rows = rows.train_step((ids, mask), labels)
    assert abs(by_rows - ref_loss.item()) > 1e-3, (by_rows, ref_loss.item())


def first_batch_cut(ctx: Ctx) -> dict[str, Any]:
    """``from_hf`` with default options on a llama trained on sequences of 256, whose attention (over the sequence's
    square) no parameter count sees: the build's cut is ``[5, 1]`` by parameters; the first ``train_step`` counts the
    decoder layers on rank 0, every rank moves to that cut before the step, and the step's loss and gradients are the
    one-process model's."""
    import transformers as tf

    vocab = 1024
    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=2)  # fmt: skip

    def fresh_model() -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return tf.LlamaForCausalLM(config).to(torch.float64)

    model = fresh_model()
    ref = copy.deepcopy(model)
    pipe = sw.Pipeline.from_hf(model, schedule="1f1b", microbatches=3, group=ctx.group, timeout=TIMEOUT)
    built = [len(r) for r in pipe.layer_ranges]
    ids = torch.randint(0, vocab, (7, 256), generator=torch.Generator().manual_seed(1))
    loss = pipe.train_step(ids, ids.clone())
    counts = [len(r) for r in pipe.layer_ranges]
    logits = ref(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    want.backward()
    assert built == [5, 1] and counts[0] < 5 and pipe.replanned_cut == counts, (built, counts, pipe.replanned_cut)
    assert gather_objects(counts, ctx.group) == [counts] * ctx.world, "ranks disagree on the cut"
    assert abs(loss - want.item()) <= LOSS_TOL, (loss, want.item())
    assert_grads_close(pipe, ref, "from_hf re-cut at the first batch", aliases=True)
    return {"built": built, "after the first batch": counts, "resumed": _resumed_cut(pipe, fresh_model, ids, ctx)}


def _resumed_cut(pipe: Any, model: Callable[[], Any], ids: torch.Tensor, ctx: Ctx) -> list[int]:
    """The cut the first batch decided, recorded as the run's own: a restart, built by parameters again, takes it
    back from the checkpoint (its state the saved one exactly, and no re-cut at its first batch), and so does the
    restart after it."""
    cut = [len(r) for r in pipe.layer_ranges]
    for k in range(2):
        root = Path(gather_objects(tempfile.mkdtemp(prefix="hfcut") if ctx.rank == 0 else None, ctx.group)[0])
        sw.checkpoint.save(root, pipe, step=1 + k)
        again = sw.Pipeline.from_hf(model(), schedule="1f1b", microbatches=3, group=ctx.group, timeout=TIMEOUT)
        assert [len(r) for r in again.layer_ranges] == [5, 1], again.layer_ranges
        info = sw.checkpoint.resume(root, again)
        assert info is not None and info.layout["pipeline"]["partition"] == "re-planned", info
        assert [len(r) for r in again.layer_ranges] == cut, ([len(r) for r in again.layer_ranges], cut)
        mine, theirs = again.state_dict(), pipe.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in mine)
        again.train_step(ids, ids.clone())
        assert [len(r) for r in again.layer_ranges] == cut  # no re-cut at a resumed pipeline's first batch
        pipe = again
    return cut


def refusals(ctx: Ctx) -> None:
    """Options from_hf cannot honour name themselves, on every rank alike."""
    model = build("llama", 2)
    raises(ValueError, "decoder layers; LlamaForCausalLM has 2", lambda: sw.Pipeline.from_hf(model, schedule="zb-v"))
    raises(ValueError, "seed=", lambda: sw.Pipeline.from_hf(model, seed=1))


# ---- the suites ---------------------------------------------------------------------------------
def grid(world: int) -> dict[str, Check]:
    """Every family x (1f1b, zb-v) x (tied, untied), 2 layers per rank; the tied sum under every schedule."""
    out: dict[str, Check] = {f"llama-tied-{s}": tied_sum(s, world) for s in sw.schedule_names(synchronous=True)}
    for family in FAMILIES:
        for schedule in ("1f1b", "zb-v"):
            for tied in (False, True):
                name = f"{family}-{schedule}-{'tied' if tied else 'untied'}"
                out[name] = parity(family, schedule, world + 1, 2 * world, tied=tied)
    return out


#: the tied sum in CI: one schedule per placement (one stage a rank, looped, V) and per backward (whole, split into
#: I and W, DualPipeV's pairs); the grid runs it under every synchronous schedule
TIED_CI = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")


def tied_sum(schedule: str, p: int) -> Check:
    """Llama with its head tied to its embedding under ``schedule`` on ``p`` ranks, against one process."""
    return parity("llama", schedule, 2 * p if schedule == "dualpipe-v" else p + 1, 2 * p, tied=True)


#: families whose model differs from Llama's only inside the decoder layers (a fused projection, a norm's place, a
#: rotary fraction): the same embedding, rotary, mask, norm and head around them, so the same cut and the same tied
#: sum. CI runs the others once each; ``make hf-grid`` runs every family, tied and untied, 1f1b and zb-v, 2 and 4 ranks
LAYERS_ONLY = frozenset({"mistral", "qwen2", "olmo2", "phi3", "stablelm"})
#: families CI trains exactly in another of its checks (tied, untied under zb-v, left-padded, with recompute, or at
#: 4 ranks): a plain 1f1b check of theirs at 2 ranks adds seconds, not a path (`make hf-grid` runs them all)
ELSEWHERE = frozenset({"gemma2", "qwen3", "falcon", "olmo"})


def checks(world: int, suite: str = "ci") -> dict[str, Check]:
    if suite == "grid":
        return grid(world)
    p = world
    out: dict[str, Check] = {}
    if world == 2:
        for family in FAMILIES:  # every family once, as it comes (tied or not), but those whose layers only differ
            if family not in LAYERS_ONLY | ELSEWHERE:
                out[f"{family}-1f1b"] = parity(family, "1f1b", 3, 4)
        for family in ("gemma2", "mixtral"):
            out[f"{family}-zb-v-untied"] = parity(family, "zb-v", 3, 4, tied=False)
        for s in TIED_CI:  # the tied sum under each placement and backward split (every schedule: the grid)
            out[f"llama-tied-{s}"] = tied_sum(s, p)
        for family in ("llama", "gpt2", "qwen3"):  # (not the EAGER families: NaN rows in float64)
            out[f"{family}-left-padded-zb-h1"] = parity(family, "zb-h1", 3, 4, inputs="left")
        out["gpt2-dict-inputs-zb-v"] = parity("gpt2", "zb-v", 3, 4, inputs="dict")
        out["llama-packed-1f1b"] = parity("llama", "1f1b", 3, 4, inputs="packed")
        out["gemma3-packed-zb-v"] = parity("gemma3", "zb-v", 3, 4, inputs="packed")
        out["falcon-tied-recompute-zb-h1"] = parity("falcon", "zb-h1", 3, 4, recompute="stage")
        out["llama-parameters-gpipe"] = parity("llama", "gpipe", 3, 5, partition="parameters")
        out["gpt2-counts-1f1b"] = parity("gpt2", "1f1b", 3, 5, partition=[1, 4])
        out["gpt_bigcode-dropout-zb-v"] = dropout("zb-v", 3)
        out["llama-time-1f1b"] = parity(
            "llama", "1f1b", 3, 4, partition="time", sample_inputs=padded_batch(2, seed=0)[0][0]
        )
        out["llama-first-batch-cut"] = first_batch_cut
        out["day-two"] = day_two_checks.day_two
    else:
        # the meshes first: a tied group made by some ranks only (pp=4 1f1b ties ranks 0 and 3) leaves gloo's later
        # groups over all ranks hanging at creation (torch 2.13), so the mesh's tied group is made before any
        out["checkpoint-every-replica"] = checkpoint_every_replica
        out["qwen2-pp-dp"] = hybrid("qwen2", "dp")
        out["falcon-pp-sharding"] = hybrid("falcon", "sharding", tied=False)
        out["gpt2-tied-pp-sharding"] = hybrid("gpt2", "sharding", tied=True)  # issue 51: was wrong, then refused
        out["olmo-pp-tp"] = hybrid("olmo", "tp")
        out["llama-planned"] = planned("llama")
        out["gpt2-planned"] = planned("gpt2")
        for family, s, tied in (
            ("llama", "zb-v", True),
            ("gemma2", "1f1b", None),
            ("mixtral", "interleaved-1f1b", None),
        ):
            out[f"{family}-{s}"] = parity(family, s, p + 1, 2 * p, tied=tied)
    out["uneven-tokens"] = uneven_tokens
    out["refusals"] = refusals
    return out
