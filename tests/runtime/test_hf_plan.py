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


def test_auto_works_for_from_hf(one_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """... on a profile whose loss was measured (the ids as labels: ``sw.profile``'s bytes), not estimated."""
    from stagewise.runtime.assembly import auto_schedule

    model = build("llama", 4)
    ref = copy.deepcopy(model)
    (ids, mask), _ = padded_batch(2, seed=0)
    decided = []
    real = auto_schedule.with_loss_bytes
    monkeypatch.setattr(auto_schedule, "with_loss_bytes", lambda *args: decided.append(real(*args)) or decided[-1])
    pipe = sw.Pipeline.from_hf(model, schedule="auto", sample_inputs=(ids, mask), microbatches=2)
    assert "stage(s) per rank" in pipe.schedule.meta["auto"]
    assert [p.loss_bytes for p in decided] == [sw.profile(ref, (ids, mask), repeats=1, warmup=0).loss_bytes]
    _train_like_the_model(pipe, ref)


def test_from_hf_s_profiled_cut_measures_its_loss_in_bfloat16(one_rank) -> None:
    """``from_hf``'s profiled cuts (``partition="memory"``, ``memory_caps``, ``schedule="auto"``) measure the
    loss's kept bytes with the input ids as labels, as ``sw.profile`` does: ``causal_lm_loss`` upcasts bfloat16
    logits, so it keeps about twice their bytes, which the layer lists' estimate (the output's size) halves. A
    loss that refuses the ids as its targets keeps the estimate."""
    (ids, mask), _ = padded_batch(2, seed=0)
    model = build("llama", 2).to(torch.bfloat16)
    pipe = sw.Pipeline.from_hf(model, partition="memory", sample_inputs=(ids, mask))
    assert pipe.layer_profile is not None
    out = pipe.layer_profile.layers[-1].output_bytes
    assert pipe.layer_profile.loss_bytes == sw.profile(model, (ids, mask), repeats=1, warmup=0).loss_bytes
    rows, seq, vocab = *ids.shape, model.config.vocab_size
    assert pipe.layer_profile.loss_bytes >= rows * (seq - 1) * vocab * 4 > 1.5 * out  # float32: the estimate's 2x

    def wants_a_dict(logits: torch.Tensor, targets: object) -> torch.Tensor:
        if not isinstance(targets, dict):
            raise TypeError(f"this loss takes {{'labels': ids}}, got a {type(targets).__name__}")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets["labels"].flatten())

    other = sw.Pipeline.from_hf(build("llama", 2).to(torch.bfloat16), partition="memory", sample_inputs=(ids, mask),
                                loss_fn=wants_a_dict)  # fmt: skip
    assert other.layer_profile is not None and other.layer_profile.loss_bytes == out


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
