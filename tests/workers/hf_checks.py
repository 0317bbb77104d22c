"""Checks for ``Pipeline.from_hf`` (issue 15), run on every rank of one torchrun job.

    torchrun --standalone --nproc-per-node 2 tests/workers/worker.py --checks hf_checks --out DIR

Random-init tiny float64 models of transformers, built offline from config
classes: GPT-2 (tied head), Llama (untied and tied), Mistral (sliding-window
attention) and Qwen2. Each check trains two steps on a padded batch (right
padding, an attention mask, labels with -100 at the padding and elsewhere,
uneven micro-batches and uneven token counts) and compares the loss and every
gradient with the one-process model: to 1e-12 against the float64 loss
computed from the model's own float64 logits, to float32 rounding against
``model(..., labels=...).loss`` (transformers computes it in float32).
``checks(world)`` is a pure function of the world size.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gather import gather_objects
from torch import nn

import stagewise as sw

RTOL, ATOL = 1e-10, 1e-12
TIMEOUT = 90.0
V, S = 48, 8
Check = Callable[[Any], "dict[str, Any] | None"]


@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    group: Any = None


# ---- models and data ----------------------------------------------------------------
def hf_model(family: str, layers: int, seed: int = 0) -> nn.Module:
    """A random-init tiny float64 causal LM of ``family``, the same on every rank (no download)."""
    import transformers as tf

    small = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=layers, num_attention_heads=2)
    small.update(num_key_value_heads=1, max_position_embeddings=32)
    configs: dict[str, Any] = {
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=V,
            n_positions=32,
            n_embd=16,
            n_layer=layers,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        ),  # fmt: skip
        "llama": lambda: tf.LlamaConfig(**small),
        "llama-tied": lambda: tf.LlamaConfig(**small, tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**small, sliding_window=3),
        "qwen2": lambda: tf.Qwen2Config(**small),
    }
    config = configs[family]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return model


def hf_data(batch: int, seed: int, left: bool = False) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(input_ids, attention_mask)`` right- (or left-) padded to ``S``; labels -100 at the padding and elsewhere."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(1, V, (batch, S), generator=g)
    lengths = torch.randint(2, S + 1, (batch,), generator=g)
    lengths[0] = S
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    mask = mask.flip(1) if left else mask
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels = labels.masked_fill(torch.rand(batch, S, generator=g) < 0.2, -100)
    return (ids, mask), labels


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss written out: position t predicts labels[t + 1]; mean over non-ignored tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)


def compare_grads(pipe: sw.Pipeline, ref: nn.Module, what: str) -> int:
    """Every parameter's gradient against the reference's (a tied head reports ``lm_head.weight``)."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert name in ref_params, f"{what}: pipeline parameter {name!r} is not the model's"
        assert p.grad is not None, f"{what}: {name} got no gradient"
        expected = ref_params[name].grad
        torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=ATOL, msg=lambda s, n=name: f"{what} {n}: {s}")
    return len(list(pipe.named_parameters()))


# ---- checks -------------------------------------------------------------------------
def parity(
    family: str, schedule: str, m: int, layers: int, left: bool = False, as_dict: bool = False, **options: Any
) -> Check:
    """Two train steps and an eval step against a deep copy in one process; names and state-dict keys.

    ``left``: left padding; ``as_dict``: the inputs as a tokenizer gives them (``input_ids``, ``attention_mask``).
    """

    def inputs(ids: torch.Tensor, mask: torch.Tensor) -> Any:
        return {"input_ids": ids, "attention_mask": mask} if as_dict else (ids, mask)

    def check(ctx: Ctx) -> dict[str, Any]:
        model = hf_model(family, layers)
        ref = copy.deepcopy(model)
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        pipe = sw.Pipeline.from_hf(
            model, schedule=schedule, microbatches=m, group=ctx.group, timeout=TIMEOUT, **options
        )
        counts = []
        for step in range(2):
            (ids, mask), labels = hf_data(2 * m + 1, seed=step, left=left)
            loss = pipe.train_step(inputs(ids, mask), labels)
            ref.zero_grad(set_to_none=True)
            out = ref(input_ids=ids, attention_mask=mask, labels=labels)
            ref_loss = reference_loss(out.logits, labels)
            ref_loss.backward()
            assert abs(loss - ref_loss.item()) <= 1e-12, (loss, ref_loss.item())
            hf = out.loss.item()  # transformers' own loss, computed in float32
            assert abs(loss - hf) <= 4 * torch.finfo(torch.float32).eps * abs(hf), (loss, hf)
            counts.append(compare_grads(pipe, ref, f"step {step}"))
            pipe.zero_grad(set_to_none=True)
        logits = pipe.eval_step(inputs(ids, mask))
        if pipe.rank == pipe.schedule.placement[-1]:
            with torch.no_grad():
                expected = ref(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(logits, expected, rtol=RTOL, atol=ATOL)
        keys = [k for ks in gather_objects(list(pipe.state_dict()), ctx.group) for k in ks]
        assert sorted(set(keys)) == sorted(ref.state_dict()), sorted(set(keys) ^ set(ref.state_dict()))
        assert len(keys) == len(set(keys)), "a state-dict key saved on two ranks"
        return {"tied": tied, "layers per stage": [len(r) for r in pipe.layer_ranges], "params checked": counts[-1]}

    return check


def uneven_tokens(ctx: Ctx) -> None:
    """Micro-batches with very different token counts (one with none): weighting by rows would be wrong."""
    m = 3
    model = hf_model("llama", 2 * ctx.world)
    ref = copy.deepcopy(model)
    pipe = sw.Pipeline.from_hf(model, schedule="1f1b", microbatches=m, group=ctx.group, timeout=TIMEOUT)
    (ids, mask), labels = hf_data(6, seed=7)
    labels[2:4] = -100  # micro-batch 1 counts no token
    labels[4:, 1:] = ids[4:, 1:]  # micro-batch 2 counts every token
    loss = pipe.train_step((ids, mask), labels)
    ref_loss = reference_loss(ref(input_ids=ids, attention_mask=mask).logits, labels)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-12, (loss, ref_loss.item())
    compare_grads(pipe, ref, "uneven tokens")
    rows = sw.Pipeline.from_hf(  # the same loss weighted by rows, not tokens: another (wrong) number
        hf_model("llama", 2 * ctx.world), schedule="1f1b", microbatches=m, group=ctx.group, loss_weights=None
    )
    by_rows = rows.train_step((ids, mask), labels)
    assert abs(by_rows - ref_loss.item()) > 1e-3, (by_rows, ref_loss.item())


def refusals(ctx: Ctx) -> None:
    """Options from_hf cannot honour name themselves."""
    model = hf_model("llama", 2)

    def raises(kind: type[BaseException], text: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except kind as err:
            assert text in str(err), f"expected {text!r} in {err}"
            return
        raise AssertionError(f"no {kind.__name__} ({text!r})")

    raises(ValueError, "decoder layers; LlamaForCausalLM has 2", lambda: sw.Pipeline.from_hf(model, schedule="zb-v"))
    raises(TypeError, "seed=", lambda: sw.Pipeline.from_hf(model, seed=1))


def checks(world: int) -> dict[str, Check]:
    p = world
    out: dict[str, Check] = {}
    if world == 2:
        for s in sw.schedule_names(synchronous=True):
            m = 2 * p if s == "dualpipe-v" else p + 1
            for family in ("gpt2", "llama", "llama-tied"):
                out[f"{family}-{s}"] = parity(family, s, m, layers=2 * p)
        out["mistral-1f1b"] = parity("mistral", "1f1b", 3, layers=2 * p)
        out["qwen2-zb-v"] = parity("qwen2", "zb-v", 3, layers=2 * p)
        out["llama-left-padded-zb-h1"] = parity("llama", "zb-h1", 3, layers=2 * p, left=True)
        out["gpt2-left-padded-1f1b"] = parity("gpt2", "1f1b", 3, layers=2 * p, left=True)
        out["gpt2-dict-inputs-zb-v"] = parity("gpt2", "zb-v", 3, layers=2 * p, as_dict=True)
        out["llama-tied-recompute-zb-h1"] = parity("llama-tied", "zb-h1", 3, layers=2 * p, recompute="stage")
        out["llama-parameters-gpipe"] = parity("llama", "gpipe", 3, layers=5, partition="parameters")
        out["gpt2-counts-1f1b"] = parity("gpt2", "1f1b", 3, layers=5, partition=[1, 4])
        out["llama-time-1f1b"] = parity(
            "llama", "1f1b", 3, layers=4, partition="time", sample_inputs=hf_data(2, seed=0)[0]
        )
    else:
        for family, s in (
            ("gpt2", "1f1b"),
            ("gpt2", "zb-v"),
            ("llama", "zb-h1"),
            ("llama", "interleaved-1f1b"),
            ("llama-tied", "dualpipe-v"),
            ("llama-tied", "1f1b"),
            ("mistral", "zb-v"),
        ):
            m = 2 * p if s == "dualpipe-v" else p + 1
            out[f"{family}-{s}"] = parity(family, s, m, layers=2 * p)
    out["uneven-tokens"] = uneven_tokens
    out["refusals"] = refusals
    return out
