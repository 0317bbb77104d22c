"""``from_hf`` in one process (issues 15 and 31): discovery on every family, the equivalence check and the mutants
it refuses, masks and packing against ``model(..., use_cache=False)``, the refusals, the tensor-parallel plan,
the causal-LM loss and its token weights. The multi-process parity is in tests/distributed/test_hf_ranks.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
import transformers as tf

import stagewise as sw
from helpers.hf_families import EAGER, FAMILIES, S, V, build, packed_positions, padded_batch
from stagewise.runtime.engine.batches import prepare_step
from stagewise.runtime.frontends.hf import FromHF, HFStage, check_model, recognise
from stagewise.runtime.frontends.hf.check import ULPS
from stagewise.runtime.frontends.hf.tp_plan import default_tp_plan


def pieces(model: nn.Module, cuts: list[int]) -> list[HFStage]:
    """The model cut after the decoder layers in ``cuts`` (``[1, 2]``: layers 0-1 | 2 | the rest)."""
    layout = recognise(model)
    n = len(model.get_submodule(layout.layers))
    bounds = [0, *cuts, n]
    return [HFStage(model, layout, range(a, b), a == 0, b == n) for a, b in zip(bounds, bounds[1:])]


def chained(parts: list[HFStage], *inputs: Any) -> torch.Tensor:
    x: Any = inputs
    for part in parts:
        x = part(*x)
    return x


# ---- discovery and the check, on every family ---------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_found_and_passes_the_check(family: str) -> None:
    """The layer list, embedding and head found, every module owned by one end, and the pieces exact: the check
    measures no difference at all (the pieces run the model's own operations)."""
    model = build(family, layers=3)
    layout = recognise(model)
    assert len(model.get_submodule(layout.layers)) == 3
    owned = [*layout.first, *layout.last]
    assert len(owned) == len(set(owned)) and set(layout.shared) <= set(layout.first), layout
    params = {id(p) for n in owned for p in model.get_submodule(n).parameters()}
    params |= {id(p) for p in model.get_submodule(layout.layers).parameters()}
    assert params == {id(p) for p in model.parameters()}, "a parameter no stage owns"
    assert check_model(model, layout) == 0.0


def test_discovery_follows_the_forward_not_the_names() -> None:
    """OPT registers its output projection before its layers but runs it after; Bloom's forward takes no
    positions; Falcon's layers return tuples; GPT-2 keeps its layer list under ``h`` without a pipeline plan."""
    opt = recognise(build("opt"))
    assert opt.layers == "model.decoder.layers" and "model.decoder.project_out" in opt.last
    assert "model.decoder.project_in" in opt.first and "model.decoder.embed_positions" in opt.shared
    assert not recognise(build("bloom")).takes_positions
    assert recognise(build("falcon")).tuple_layers and not recognise(build("llama")).tuple_layers
    gpt2 = recognise(build("gpt2"))
    assert (gpt2.layers, gpt2.embed, gpt2.head) == ("transformer.h", "transformer.wte", "lm_head")
    assert gpt2.shared == ("transformer.wpe", "transformer.drop")


def test_probe_and_check_leave_the_model_as_they_found_it() -> None:
    model = build("falcon", layers=3).train()
    FromHF(model)
    assert model.training and all(m.training for m in model.modules())
    for layer in model.get_submodule("transformer.h"):
        assert "forward" not in layer.__dict__ and not layer._forward_hooks and not layer._forward_pre_hooks


# ---- masks, padding, packing: against model(..., use_cache=False) --------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "falcon_alibi", "bloom", "opt"])
def test_padded_batches(family: str) -> None:
    """Right and left padding (not for the EAGER families: their float64 kernel gives NaN rows for a query that
    sees no key, in the model itself) on pieces cut at two places."""
    model = build(family, layers=4).eval()
    for left in (False, True) if family not in EAGER else (False,):
        (ids, mask), _ = padded_batch(4, seed=1, left=left)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = chained(pieces(model, [1, 3]), ids, mask)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
def test_packed_documents_and_4d_masks(family: str) -> None:
    """Position ids restarting per document isolate the documents, and a 4-D mask is taken as it is, as
    ``model(..., use_cache=False)`` does. That call is the reference: with a cache (the default of an inference
    call) transformers treats the call as generation and lets packed documents see each other."""
    model = build(family, layers=3).eval()
    ids = padded_batch(3, seed=2)[0][0]
    positions = packed_positions(3, seed=2)
    doc = (positions == 0).cumsum(1)
    block = ((doc[:, :, None] == doc[:, None, :]) & torch.tril(torch.ones(S, S, dtype=torch.bool)))[:, None]
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        cached = model(input_ids=ids, position_ids=positions).logits
        assert (cached - expected).abs().max() > 1e-3, "packing should matter for this batch"
        torch.testing.assert_close(chained(pieces(model, [1]), ids, None, positions), expected, rtol=0, atol=0)
        expected = model(input_ids=ids, attention_mask=block, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(chained(pieces(model, [2]), ids, block, positions), expected, rtol=0, atol=0)


def test_inputs_as_a_tokenizer_gives_them() -> None:
    model = build("qwen2", layers=2).eval()
    (ids, mask), _ = padded_batch(3, seed=3)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = chained(pieces(model, [1]), {"input_ids": ids, "attention_mask": mask})
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="input_ids .required."):
        chained(pieces(model, [1]), {"input_ids": ids, "token_type_ids": mask})


def test_positions_refused_where_the_forward_takes_none() -> None:
    ids = padded_batch(2, seed=0)[0][0]
    with pytest.raises(ValueError, match="BloomForCausalLM's forward takes no position_ids"):
        chained(pieces(build("bloom"), [1]), ids, None, packed_positions(2, 0))


# ---- the check refuses what would be silently wrong ------------------------------------------------
class Replay(nn.Module):
    """A mutant: a piece that replays a causal LM's forward by hand, as the allowlist of issue 15 did (masks and
    rotary embeddings rebuilt, the layers called with Llama's arguments, then norm and head). Right for Llama;
    it misses Gemma 2's soft-capping, Granite's multipliers, Cohere's logit scale, Gemma 3's local rotary."""

    def __init__(self, model: nn.Module, ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.__dict__["model"] = model
        self.ids, self.first, self.last = ids, first, last

    def forward(self, *args: Any) -> Any:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        base = self.model.model
        if self.first:
            ids, mask = args
            hidden, positions = base.embed_tokens(ids), torch.arange(ids.shape[1])[None]
        else:
            hidden, mask, positions = args
        kw = dict(config=base.config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None)
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        kinds = getattr(base.config, "layer_types", None) or ["full_attention"] * len(base.layers)
        masks = {kind: makers[kind](**kw, position_ids=positions) for kind in set(kinds)}
        rotary = base.rotary_emb(hidden, position_ids=positions)
        for i in self.ids:
            hidden = base.layers[i](hidden, attention_mask=masks[kinds[i]], position_ids=positions,
                                    position_embeddings=rotary, use_cache=False)  # fmt: skip
        return self.model.lm_head(base.norm(hidden)) if self.last else (hidden, mask, positions)


@pytest.mark.parametrize(
    ("family", "where"),
    [("gemma2", "the logits"), ("cohere", "the logits"), ("granite", "decoder layer 0"), ("gemma3", "decoder layer")],
)
def test_check_refuses_a_replay_that_misses_the_family_maths(family: str, where: str) -> None:
    model = build(family, layers=3)
    replay = [Replay(model, range(i, i + 1), i == 0, i == 2) for i in range(3)]
    with pytest.raises(ValueError, match=f"from_hf refuses .*model_type .*: chained on a 2x8 batch.*{where}"):
        check_model(model, recognise(model), replay)


def test_the_replay_mutant_is_right_where_it_should_be() -> None:
    """The control: the same replay on Llama passes, so the refusals above are about the families' maths."""
    model = build("llama", layers=3)
    assert check_model(model, recognise(model), [Replay(model, range(i, i + 1), i == 0, i == 2) for i in range(3)]) == 0


def test_check_refuses_layers_passed_on_unpacked() -> None:
    """A mutant layout that does not know Falcon's forward unpacks its layers' tuples: refused, not wrong."""
    model = build("falcon", layers=3)
    layout = dataclasses.replace(recognise(model), tuple_layers=False)
    with pytest.raises(ValueError, match="from_hf refuses FalconForCausalLM .*decoder layer 1"):
        check_model(model, layout)


def test_check_refuses_weights_before_the_layers_that_later_stages_use() -> None:
    """A mutant Llama whose rotary embedding learns a scale: every stage would use its own copy, trained on the
    first stage only. Equal at the start (the pieces agree), so the check changes those weights and looks."""
    model = build("llama", layers=3)
    rotary = model.model.rotary_emb
    rotary.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    rotary.register_forward_hook(lambda m, args, out: tuple(o * m.scale for o in out))
    with pytest.raises(ValueError, match=r"decoder layer 1 .* depends on the weights of \['model.rotary_emb'\]"):
        check_model(model, recognise(model))


def test_check_skipped_on_request(one_rank: Any) -> None:
    """``FromHF(model, check=False)`` skips the check and trains the same (zb-v on one rank: two stages)."""
    model = build("gemma2", layers=4)
    assert FromHF(model).checked == 0.0
    assert FromHF(model, check=False).checked is None
    ref = build("gemma2", layers=4)
    pipe = sw.Pipeline(FromHF(model, check=False), schedule="zb-v", microbatches=3)
    (ids, mask), labels = padded_batch(5, seed=0)
    loss = pipe.train_step((ids, mask), labels)
    assert loss == pytest.approx(
        sw.causal_lm_loss(ref(input_ids=ids, attention_mask=mask).logits, labels).item(), rel=1e-12
    )


def test_a_freed_model_is_refused_by_name() -> None:
    model = build("llama")
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match="meta device"):
        recognise(model)


# ---- refusals that point the right way ---------------------------------------------------------
def test_encoder_decoder_refused() -> None:
    model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=1))
    with pytest.raises(ValueError, match="encoder-decoder model"):
        recognise(model)


def test_base_model_refused_naming_the_causal_lm() -> None:
    with pytest.raises(ValueError, match="LlamaModel is a base model without one .*LlamaForCausalLM"):
        recognise(build("llama").model)


def test_other_heads_refused_without_the_base_model_hint() -> None:
    model = tf.LlamaForSequenceClassification(build("llama").config)
    with pytest.raises(ValueError, match="has no LM head") as err:
        recognise(model)
    assert "base model" not in str(err.value)


def test_extra_heads_refused() -> None:
    """GPT2DoubleHeadsModel's multiple-choice head would never be trained nor saved."""
    with pytest.raises(ValueError, match=r"\['multiple_choice_head'\]"):
        recognise(tf.GPT2DoubleHeadsModel(build("gpt2").config))


def test_router_loss_refused_with_the_reason() -> None:
    model = build("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits = False"):
        recognise(model)
    model.config.output_router_logits = False
    assert recognise(model).family == "mixtral"


def test_transformers_checkpointing_refused() -> None:
    model = build("llama")
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="recompute="):
        recognise(model)


def test_layer_list_not_found_lists_what_it_saw() -> None:
    model = build("llama", layers=2)
    model.config.base_model_pp_plan = None
    model.config.num_hidden_layers = 5
    with pytest.raises(ValueError, match=r"num_hidden_layers \(5\).*'lm_head', 'model', 'model.embed_tokens'"):
        recognise(model)


def test_not_a_transformers_model() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        recognise("gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="PreTrainedModel"):
        recognise(nn.Linear(2, 2))


def test_from_model_points_to_from_hf() -> None:
    with pytest.raises(TypeError, match="use Pipeline.from_hf"):
        sw.Pipeline.from_model(build("llama"), schedule="1f1b")


# ---- the tensor-parallel plan -------------------------------------------------------------------
def test_tp_plan_from_the_config() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = build("llama")
    plan = default_tp_plan(model, recognise(model))
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel) and len(plan) == 7
    with pytest.raises(ValueError, match="replicated_with_grad_allreduce"):
        default_tp_plan(build("qwen3"), recognise(build("qwen3")))
    with pytest.raises(ValueError, match="no base_model_tp_plan"):
        default_tp_plan(build("gpt2"), recognise(build("gpt2")))
    options = sw.Options(parallel=sw.ParallelConfig(pp=2, tp=2))
    assert FromHF(model, check=False).defaults(options).tp_plan is not None
    assert FromHF(model, check=False).defaults(sw.Options(parallel=sw.ParallelConfig(pp=2, dp=2))).tp_plan is None


# ---- the loss -----------------------------------------------------------------------------------
def test_causal_lm_loss_is_transformers_loss() -> None:
    """Against transformers' own ForCausalLMLoss (float32) and the float64 formula written out."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (3, 6), generator=g)
    labels[0, :3] = -100
    labels[2, 4:] = -100
    ours = sw.causal_lm_loss(logits, labels)
    theirs = ForCausalLMLoss(logits, labels, vocab_size=V)
    written = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert ours.dtype == torch.float64
    assert abs(ours.item() - written.item()) <= 1e-14
    assert abs(ours.item() - theirs.item()) <= 4 * torch.finfo(torch.float32).eps * abs(theirs.item())
    assert sw.count_tokens(labels) == int((labels[:, 1:] != -100).sum()) == 11
    nothing = torch.full_like(labels, -100)
    assert sw.causal_lm_loss(logits, nothing).item() == 0.0 and sw.count_tokens(nothing) == 0
    with pytest.raises(ValueError, match="logits .batch, seq, vocab."):
        sw.causal_lm_loss(logits[0], labels)


def _weights(targets: torch.Tensor, m: int, loss_weights: Any = None) -> list[float]:
    step = prepare_step(
        "train", None, targets, rank=1, placement=(0, 1), num_microbatches=m, batch_dims=(0, 0),
        device=torch.device("cpu"), has_loss=True, loss_weights=loss_weights,
    )  # fmt: skip
    assert step.weights is not None
    return step.weights


def test_loss_weights_by_tokens() -> None:
    labels = torch.full((5, 4), -100)
    labels[0, 1:] = 1  # 3 tokens in micro-batch 0 (rows 0-1)
    labels[4, 2:] = 1  # 2 tokens in micro-batch 2 (row 4); micro-batch 1 (rows 2-3) has none
    assert _weights(labels, 3) == [2 / 5, 2 / 5, 1 / 5]  # the default: rows
    assert _weights(labels, 3, sw.count_tokens) == [3 / 5, 0.0, 2 / 5]
    with pytest.raises(ValueError, match="counted nothing"):
        _weights(torch.full((4, 4), -100), 2, sw.count_tokens)
    with pytest.raises(ValueError, match="micro-batch 0: expected a count >= 0"):
        _weights(labels, 3, lambda y: -1)


def test_ulps_allow_no_more_than_rounding() -> None:
    """The check's tolerance in float64 is far below what the mutants above miss by."""
    assert ULPS * torch.finfo(torch.float64).eps < 1e-13


def test_core_imports_without_transformers() -> None:
    """``import stagewise`` and the Pipeline (from_hf included) do not import transformers until a model is cut."""
    code = (
        "import sys, stagewise as sw; sw.Pipeline; import stagewise.runtime.frontends.hf; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_check_runs_with_dropout_off_and_says_so() -> None:
    """A model in training mode with dropout (GPT-BigCode's 0.1 defaults) passes the check exactly: it runs in eval
    mode, and says so in what it refuses; the model's own modes come back after."""
    from helpers.hf_families import with_dropout

    model = with_dropout(layers=3)
    assert check_model(model, recognise(model)) == 0.0
    assert all(m.training for m in model.modules())
    gemma = build("gemma2", layers=3)
    replay = [Replay(gemma, range(i, i + 1), i == 0, i == 2) for i in range(3)]
    with pytest.raises(ValueError, match="chained on a 2x8 batch in eval mode \\(no dropout\\)"):
        check_model(gemma, recognise(gemma), replay)


class _MatmulDtypes(torch.overrides.TorchFunctionMode):
    """Records the dtypes ``torch.matmul`` runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.matmul:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_gpt_neo_attention_is_float32_but_per_sample() -> None:
    """GPT-Neo casts query and key to float32 inside a float64 model (q k^T and, without a padding mask, its softmax
    run in float32), so its q_proj and k_proj gradients carry float32 rounding. But per sample: the model run on the
    pipeline's micro-batches gives every gradient the whole batch's to float64 rounding, so micro-batching adds no
    float32 error, and a pipeline running the model's own kernels on those micro-batches is exact (the 2-rank
    parity check; docs/guides/hugging-face.md, the family table)."""
    model = build("gpt_neo", layers=2)
    (ids, mask), labels = padded_batch(7, seed=0)
    m = 3

    def loss_of(i: torch.Tensor, k: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=i, attention_mask=k, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")

    with _MatmulDtypes() as dtypes:
        total = (labels[:, 1:] != -100).sum()
        (loss_of(ids, mask, labels) / total).backward()
    assert dtypes.seen == {torch.float32, torch.float64}, dtypes.seen  # q k^T in float32, the rest in float64
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for i, k, y in zip(ids.tensor_split(m), mask.tensor_split(m), labels.tensor_split(m)):
        (loss_of(i, k, y) / total).backward()
    for name, p in model.named_parameters():
        err = float((p.grad - whole[name]).abs().max() / whole[name].abs().max())
        assert err < 1e-13, (name, err)  # float64 rounding of the sums over rows, not float32's 6e-8


def test_a_calibrator_s_prior_prices_the_decoder_layers_at_the_first_batch(one_rank: Any) -> None:
    """``from_hf`` cut without ``sample_inputs`` has no profile; a RunCalibrator built before the first step asks the
    first batch to price its units (a decoder layer each, the embedding with the first, the head with the last),
    counted on the meta device as the default cut counts them: what the run's calibration scales instead of an even
    spread. The ask is answered once; the step itself is the model's."""
    from stagewise.runtime import RunCalibrator
    from stagewise.runtime.frontends import default_cut, first_batch

    model, ref = build("llama", layers=4), build("llama", layers=4)
    pipe = sw.Pipeline(FromHF(model, check=False), schedule="zb-v", microbatches=3)  # two stages on one rank
    assert pipe.layer_profile is None and not pipe.prior_wanted
    RunCalibrator(pipe, cores=1)
    assert pipe.prior_wanted
    (ids, mask), labels = padded_batch(6, seed=0)
    first = first_batch._first_microbatch(pipe, (ids, mask))
    loss = pipe.train_step((ids, mask), labels)
    assert loss == pytest.approx(
        sw.causal_lm_loss(ref(input_ids=ids, attention_mask=mask).logits, labels).item(), rel=1e-12
    )
    want = default_cut.priced(FromHF(ref, check=False).units(), first, seed=0, device="cpu")
    assert want[1] == "counted" and pipe.layer_profile == want[0] and not pipe.prior_wanted
    times = pipe.layer_profile.times()
    assert len(times) == 4 and times[3] > 1.1 * max(times[:3]), times  # the head's unit priced above the others
