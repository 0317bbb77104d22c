"""Train a small random-init causal LM of Hugging Face transformers on the standard library's source, 4 stages.

    stagewise run -n 4 examples/hf_causal_lm.py --out out/hf-llama
    stagewise run -n 4 examples/hf_causal_lm.py --model gemma2 --out out/hf-gemma2

``--model`` picks a family from :data:`MODELS` (Llama, Mistral, Qwen 2 and 3, Gemma 1 and 2, Phi-3, OLMo 2,
Granite, GPT-2, GPT-NeoX / Pythia, Falcon, Bloom, Mixtral), built at the sizes the flags give. Every process
builds the same random-init model (same seed, bytes as tokens: vocabulary 256, head tied to the token
embedding) and hands it to ``sw.Pipeline.from_hf``, which checks that its pieces reproduce the model, cuts it
among its decoder layers and frees the other stages' weights. The loss is transformers' own causal-LM loss
(``labels = input_ids``, shifted inside), averaged over the tokens of the whole batch. The rank holding the
last stage shows the progress and writes, under ``--out``:

* ``loss_curve.png`` and ``metrics.csv``: training loss per step, validation loss;
* ``timeline_measured.png`` / ``timeline_simulated.png`` / ``timeline_compare.png`` (and traces);
* ``model/``: the trained model, gathered from the stages and written with ``save_pretrained``;
  it is reloaded with ``AutoModelForCausalLM.from_pretrained`` and generates a few bytes;
* ``summary.json``: the numbers of the summary table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stagewise as sw
from gpt_data import STDLIB_FILES, VOCAB_SIZE, batches, eval_batches, split, stdlib_corpus
from reporting import MetricsLog, TrainingProgress, console, measured_costs, summary_table, typical, write_timelines
from stagewise.runtime import gather_state_dict, plot_losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama", choices=sorted(MODELS), help="the family (default llama)")
    p.add_argument("--out", type=Path, default=Path("out/hf-llama"), help="output folder (default out/hf-llama)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (see `stagewise schedules`)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, grouped-query attention (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate of AdamW (default 3e-3)")
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (default 50)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches (default 4)")
    p.add_argument("--timeline-every", type=int, default=10, help="measure the bubble every N steps (default 10)")
    p.add_argument("--generate", type=int, default=60, help="bytes to generate from the reloaded model (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the batches (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines")
    p.add_argument("--verbose", action="store_true", help="log stagewise's INFO messages")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "microbatches", "eval_every", "eval_batches", "timeline_every", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


#: ``--model``: transformers' config type, the family's name, and what sets the family apart (at these sizes)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "Llama", {}),
    "mistral": ("mistral", "Mistral", {"sliding_window": 32}),
    "qwen2": ("qwen2", "Qwen2", {}),
    "qwen3": ("qwen3", "Qwen3", {}),
    "gemma": ("gemma", "Gemma", {}),
    "gemma2": ("gemma2", "Gemma 2", {"sliding_window": 32, "final_logit_softcapping": 30.0}),
    "phi3": ("phi3", "Phi-3", {}),
    "olmo2": ("olmo2", "OLMo 2", {}),
    "granite": (
        "granite",
        "Granite",
        {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0},
    ),
    "gpt2": ("gpt2", "GPT-2", {}),
    "pythia": ("gpt_neox", "GPT-NeoX (Pythia)", {"rotary_pct": 0.25}),
    "falcon": ("falcon", "Falcon", {}),
    "bloom": ("bloom", "Bloom", {}),
    "mixtral": ("mixtral", "Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def model_config(args: argparse.Namespace) -> Any:
    """The ``--model`` family's config at the flags' sizes (a flag a family has no use for is ignored by it)."""
    from transformers import AutoConfig

    model_type, _, extra = MODELS[args.model]
    return AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=(args.hidden * 8 // 3 + 7) // 8 * 8,  # (a multiple of 8: MoE kernels need it)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **extra,
    )


def build_model(config: Any, seed: int) -> torch.nn.Module:
    """The random-init model; the same ``seed`` gives the same weights in every process."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    started = time.perf_counter()
    sw.init()
    config = model_config(args)
    model = build_model(config, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    pipe = sw.Pipeline.from_hf(
        model,
        schedule=args.schedule,
        microbatches=args.microbatches,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0),
    )
    reports = pipe.rank == pipe.schedule.placement[-1]
    corpus = stdlib_corpus()
    train_data, valid_data = split(corpus)
    valid = [x for x, _ in eval_batches(valid_data, args.batch_size, args.seq_len, args.eval_batches)]
    if reports:
        args.out.mkdir(parents=True, exist_ok=True)
        layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in pipe.layer_ranges)
        console.print(
            f"[bold]stagewise[/bold]: a random-init {type(model).__name__} ({parameters:,} parameters) on "
            f"{len(corpus):,} bytes of {len(STDLIB_FILES)} standard-library files; {pipe.num_ranks} processes, "
            f"schedule {pipe.schedule.name}, {pipe.schedule.num_stages} stages holding decoder layers {layers}"
        )

    def eval_loss() -> float | None:
        pipe.eval()  # no dropout (GPT-2's, Bloom's) while validating
        losses = [pipe.eval_step(x) for x in valid]  # logits where the last stage is, None elsewhere
        pipe.train()
        return statistics.fmean(float(sw.causal_lm_loss(lg, x)) for lg, x in zip(losses, valid)) if reports else None

    metrics = MetricsLog(args.out) if reports else None
    progress = TrainingProgress(args.steps, unit="tok/s", enabled=reports and not args.no_progress)
    recent: deque[float] = deque(maxlen=20)
    timelines: list[sw.Timeline] = []
    bubble, busy = None, 0.0
    if metrics is not None:
        metrics.log(0, val_loss=eval_loss())
    else:
        eval_loss()
    data = batches(train_data, args.batch_size, args.seq_len, seed=args.seed)
    try:
        for step in range(1, args.steps + 1):
            x, _ = next(data)
            t0 = time.perf_counter()
            loss = pipe.train_step(x, x)  # inputs and labels: transformers shifts the labels by one
            recent.append(time.perf_counter() - t0)
            busy += recent[-1]
            if step % args.timeline_every == 0 or step == args.steps:
                timeline = pipe.timeline(gather=True)  # a collective: every rank calls it at the same steps
                bubble = timeline.bubble_ratio
                timelines = (timelines + [timeline])[-10:]
            val = eval_loss() if step % args.eval_every == 0 or step == args.steps else None
            if metrics is not None:
                rate = args.batch_size * args.seq_len * len(recent) / sum(recent)
                metrics.log(step, loss=loss, lr=args.lr, rate=rate, bubble=bubble, val_loss=val)
                progress.update(step, loss, rate, bubble)
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()
    state = gather_state_dict(pipe, dst=pipe.schedule.placement[-1])  # a collective
    schedule = pipe.schedule
    dist.destroy_process_group()  # before save_pretrained, which writes on the group's rank 0 only
    if reports:
        assert metrics is not None and state is not None
        report(args, config, metrics, timelines, state, schedule, busy, time.perf_counter() - started, valid)
    return 0


def report(
    args: argparse.Namespace,
    config: Any,
    metrics: MetricsLog,
    timelines: list[sw.Timeline],
    state: dict[str, torch.Tensor],
    schedule: sw.Schedule,
    busy: float,
    wall: float,
    valid: list[torch.Tensor],
) -> None:
    """Save with save_pretrained, reload with from_pretrained, evaluate and generate; figures and summary."""
    from transformers import AutoModelForCausalLM

    out = args.out
    fresh = build_model(config, args.seed + 1)  # other weights, so that loading them means something
    fresh.load_state_dict(state)  # strict: every key of the model's state dict, gathered from the stages
    fresh.save_pretrained(out / "model")
    reloaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    with torch.no_grad():
        reloaded_loss = statistics.fmean(float(reloaded(input_ids=x, labels=x).loss) for x in valid)
        prompt = torch.tensor([list(b"def ")])
        generated = reloaded.generate(prompt, max_new_tokens=args.generate, do_sample=False, pad_token_id=0)
    text = bytes(generated[0, prompt.shape[1] :].tolist()).decode("utf-8", errors="replace")
    losses, vals = metrics.series("loss"), metrics.series("val_loss")
    final_train = statistics.fmean(loss for _, loss in losses[-20:])
    family = MODELS[args.model][1]
    plot_losses(
        losses, vals, out / "loss_curve.png", title=f"{family} (transformers) on stdlib source, {schedule.name}"
    )
    costs = measured_costs(timelines[1:] or timelines, schedule.num_stages)
    simulated = write_timelines(typical(timelines), schedule, costs, out)
    measured = statistics.fmean(t.bubble_ratio for t in timelines)
    summary = {
        "parameters": sum(p.numel() for p in reloaded.parameters()),
        "first_loss": losses[0][1],
        "final_train_loss": final_train,
        "first_val_loss": vals[0][1],
        "final_val_loss": vals[-1][1],
        "reloaded_val_loss": reloaded_loss,
        "generated": text,
        "bubble_measured": measured,
        "bubble_simulated": simulated.bubble_ratio,
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / busy,
        "train_seconds": busy,
        "wall_seconds": wall,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary_table(
        f"stagewise: a transformers {family} on the Python standard library",
        [
            ("model", f"{type(reloaded).__name__}, {summary['parameters']:,} parameters, {args.layers} layers"),
            ("mode", f"{schedule.num_ranks} processes, {schedule.name}, {schedule.num_microbatches} micro-batches"),
            ("train loss", f"{losses[0][1]:.3f} -> {final_train:.3f} (mean of the last 20 steps)"),
            (
                "validation loss",
                f"{vals[0][1]:.3f} -> {vals[-1][1]:.3f}  (reloaded by transformers: {reloaded_loss:.3f})",
            ),
            ("bubble", f"{measured:.1%} measured, {simulated.bubble_ratio:.1%} simulated"),
            ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s"),
            ("time", f"{busy:.1f} s training, {wall:.1f} s in all"),
            ("outputs", str(out)),
        ],
    )
    console.print("[bold]generated by the reloaded model[/bold] (prompt 'def '):")
    console.print("def " + text, markup=False)


if __name__ == "__main__":
    sys.exit(main())
