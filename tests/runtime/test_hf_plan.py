"""Planning a transformers model (issue 51 item 1): ``sw.profile`` measures it per decoder layer, as ``from_hf``
cuts it; a plan of that profile is built by ``Pipeline.from_plan(plan, model)`` and
``from_hf(**plan.pipeline_options())`` and trains as the model does; ``schedule="auto"`` works for ``from_hf``.
On a one-rank group (4 processes: tests/distributed/workers/hf_checks.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import stagewise as sw

pytest.importorskip("transformers")

from helpers.hf_families import build, padded_batch  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_transformers_model_is_profiled_per_decoder_layer(family: str) -> None:
    model = build(family, 3)
    (ids, mask), _ = padded_batch(2, seed=0)
    prof = sw.profile(model, (ids, mask))
    assert len(prof.layers) == 3 and prof.batch == 2
    assert prof.layers[0].name.endswith("0 (+" + ("model.embed_tokens)" if family == "llama" else "transformer.wte)"))
    assert prof.layers[-1].name.endswith("2 (+lm_head)")
    assert prof.layers[0].parameter_bytes > prof.layers[1].parameter_bytes  # the embedding rides with layer 0
    assert all(p.grad is None for p in model.parameters())


def test_the_profile_holds_the_loss_from_hf_trains_with() -> None:
    """Without ``loss_fn``, a transformers model's profile measures what ``from_hf``'s loss keeps (the
    log-softmax of the logits but the last position's, the input ids as labels): the same bytes as naming that
    loss, at least those logits' (a plan leaving them out may not fit the last stage)."""
    from stagewise.runtime.losses import causal_lm_loss

    model = build("llama", 2)
    (ids, mask), _ = padded_batch(2, seed=0)
    default = sw.profile(model, (ids, mask), repeats=1, warmup=0)
    named = sw.profile(model, (ids, mask), repeats=1, warmup=0, loss_fn=causal_lm_loss, targets=ids)
    vocab = model.config.vocab_size
    assert default.loss_bytes == named.loss_bytes >= ids.shape[0] * (ids.shape[1] - 1) * vocab * 8  # float64 here
    assert sw.profile(model, ids, repeats=1, warmup=0).loss_bytes == default.loss_bytes  # ids alone alike


def _train_like_the_model(pipe: sw.Pipeline, ref: torch.nn.Module) -> None:
    (ids, mask), labels = padded_batch(4, seed=1)
    loss = pipe.train_step((ids, mask), labels)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    logits = want.logits[:, :-1].reshape(-1, want.logits.shape[-1])
    ref_loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-12)
    ref_loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12)


def test_a_plan_of_the_profile_builds_with_from_plan_and_from_hf(one_rank) -> None:
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    (ids, mask), _ = padded_batch(2, seed=0)
    plans = sw.plan(sw.profile(model, (ids, mask)), 1, global_batch=4)
    top = plans[0]
    assert sum(top.partition) == 4
    pipe = sw.Pipeline.from_plan(top, model)
    _train_like_the_model(pipe, ref)
    again = sw.Pipeline.from_hf(build("llama", 4), **top.pipeline_options())
    assert again.layer_ranges == pipe.layer_ranges
    spelled = sw.Pipeline.from_hf(build("llama", 4), plan=top)  # the other spelling
    assert spelled.layer_ranges == pipe.layer_ranges and spelled.schedule.name == pipe.schedule.name
    with pytest.raises(ValueError, match="set by the plan"):
        sw.Pipeline.from_hf(build("llama", 4), plan=top, microbatches=top.microbatches)


def test_auto_works_for_from_hf(one_rank) -> None:
    model = build("llama", 4)
    ref = copy.deepcopy(model)
    (ids, mask), _ = padded_batch(2, seed=0)
    pipe = sw.Pipeline.from_hf(model, schedule="auto", sample_inputs=(ids, mask), microbatches=2)
    assert "stage(s) per rank" in pipe.schedule.meta["auto"]
    _train_like_the_model(pipe, ref)


@pytest.mark.parametrize("how", ["name", "path"])
def test_the_cli_plans_a_transformers_config_without_downloads(tmp_path, capsys, how: str) -> None:
    import transformers as tf

    from stagewise.cli.main import main

    small = dict(num_hidden_layers=3, hidden_size=16, intermediate_size=24, num_attention_heads=2, vocab_size=40)
    if how == "path":
        tf.LlamaConfig(**small).save_pretrained(tmp_path)
        spec = str(tmp_path / "config.json")
    else:
        spec = "llama:" + ",".join(f"{k}={v}" for k, v in small.items())
    out = tmp_path / "plans.json"
    assert main(["plan", "--hf", spec, "--seq", "8", "-n", "2", "--global-batch", "4", "--json", str(out)]) == 0
    import json

    plans = json.loads(out.read_text())["plans"]
    assert plans and all(sum(p["partition"]) == 3 for p in plans)  # decoder layers, as from_hf cuts
