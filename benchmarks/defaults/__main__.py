"""Defaults that pay (issue 49 item 1): every synchronous schedule with the default cut against its best cut.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.defaults --out out/defaults             # 4 workloads, 2 ranks
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.defaults --headline --out out/headline  # the issue's GPT
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.defaults --quick --out out/defaults     # smoke run
    .venv/bin/python -m benchmarks.defaults --report out/defaults/defaults.json              # the table again

On 2 ranks of one thread, per workload (the fidelity benchmark's three, a tapered MLP no test tunes to, and with
``--workloads hf`` a transformers llama through ``Pipeline.from_hf``) and per
registered synchronous schedule (v = 2 where it takes virtual stages, 8 micro-batches), five pipelines of the same
layers: the default options (``partition`` not given, no sample inputs: the cut by parameters refined for the
schedule, or for convolutions the first batch's timed work), the default with ``sample_inputs`` (the work counted
on the meta device; timed on rank 0 where a layer holds a convolution), and ``"uniform"``, ``"parameters"``,
``"time"``, each taking one step when built (the cut and the warnings are read after it). Pipelines that cut
alike are timed once (their ratio is 1 by construction). The others take turns step by step (the order rotated
each step), after one warm-up step each; a timed step starts from a barrier and is the slowest rank's
``train_step``. Per row: each default's median over the best named cut's with a
90 % paired-bootstrap interval and its verdict (:mod:`.stats`), the schedule against 1F1B with defaults (not timed
in turn: an unpaired interval), and whether the build said the schedule is predicted slower than 1F1B (the warning,
captured: once per build at most). ``--headline``: the issue's GPT (:mod:`.headline`), ZB-V and 1F1B with defaults
and ZB-V with each named cut, all in turn.
Writes ``defaults.json`` and ``defaults.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from .._launch import launched, on_ranks, timed_step
from .stats import Ratio, paired_ratio, spread

CUTS = ("default", "default+sample", "uniform", "parameters", "time")
NAMED = ("uniform", "parameters", "time")
#: the logger of the default cut's warning (captured, so a benchmark of many builds prints none of them)
WORD_LOGGER = "stagewise.runtime.frontends.default_cut"


def dense(a: int, b: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(a, b), nn.ReLU())


def mlp_layers() -> Any:
    """A tapered MLP (widths 1024 down to 32, 11 layers): the model no test tunes to."""
    from torch import nn

    import stagewise as sw

    widths = [256, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 32]
    layers: list[Any] = [sw.Layer(dense, a, b) for a, b in zip(widths, widths[1:])]
    return [*layers, sw.Layer(nn.Linear, 32, 10)]


#: ``hf``: a transformers llama no test tunes to (8 decoder layers, d 256, a vocabulary of 8192: the head about a
#: block's work and the embedding none, where each holds as many parameters as two and a half blocks)
HF_CONFIG = {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128}  # fmt: skip
HF_SEQ = 64


def hf_model() -> Any:
    """The ``hf`` workload's model, the same on every rank (seeded), float32, sdpa attention."""
    import torch
    import transformers as tf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**HF_CONFIG, attn_implementation="sdpa"))


def workload(name: str) -> tuple[Any, Any, Any, int]:
    """(layers factory, loss, data(samples), micro-batch samples); ``hf``: (model factory, None: transformers'
    loss, token ids and their labels, micro-batch)."""
    import torch
    import torch.nn.functional as F

    if name == "hf":

        def tokens(n: int) -> Any:
            ids = torch.randint(0, HF_CONFIG["vocab_size"], (n, HF_SEQ), generator=torch.Generator().manual_seed(0))
            return ids, ids.clone()

        return hf_model, None, tokens, 4
    if name == "mlp":

        def data(n: int) -> Any:
            g = torch.Generator().manual_seed(0)
            return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)

        return mlp_layers, F.cross_entropy, data, 16
    if name == "headline":
        from . import headline

        return headline.layers, headline.loss, headline.data, headline.MICROBATCH
    from ..fidelity.workloads import workloads

    w = workloads()[name]
    return w.layers, w.loss, w.data, w.microbatch


class Words(logging.Handler):
    """The default cut's warnings, kept instead of printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def build(name: str, schedule: str, cut: str, m: int, words: Words, batch: Any) -> tuple[Any, list[str]]:
    """The pipeline after its first step on ``batch`` (the default cut without sample inputs is finished at the
    first batch: the cut is read after it), and the warnings its build and that step logged."""
    import stagewise as sw

    layers, loss, data, b = workload(name)
    x, _ = data(b)
    allowed = sw.schedule_info(schedule).virtual_stages
    v = 2 if allowed is None or 2 in allowed else None
    extra: dict[str, Any] = {}
    if cut == "default+sample":
        extra["sample_inputs"] = x
    elif cut != "default":
        extra["partition"] = cut
        extra["sample_inputs"] = x
    before = len(words.lines)
    if name == "hf":  # from_hf: its decoder layers cut, its own loss
        pipe = sw.Pipeline.from_hf(layers(), check=False, schedule=schedule, microbatches=m, virtual_stages=v, **extra)
    else:
        pipe = sw.Pipeline(layers(), loss_fn=loss, schedule=schedule, microbatches=m, virtual_stages=v, **extra)
    timed_step(pipe, *batch)
    return pipe, words.lines[before:]


def in_turn(pipes: dict[str, Any], x: Any, y: Any, steps: int) -> dict[str, list[float]]:
    """One warm-up step each, then ``steps`` timed steps each, step by step in turn, the order rotated each step
    (no pipeline always runs first after another's)."""
    for pipe in pipes.values():
        timed_step(pipe, x, y)
    names = list(pipes)
    out: dict[str, list[float]] = {n: [] for n in names}
    for k in range(steps):
        r = k % len(names)
        for n in names[r:] + names[:r]:
            out[n].append(timed_step(pipes[n], x, y))
    return out


def measure(name: str, builds: list[tuple[str, str, str]], steps: int, m: int, words: Words) -> dict[str, Any]:
    """``builds``: (key, schedule, cut); those of one schedule that cut alike are timed once."""
    _, _, data, b = workload(name)
    x, y = data(b * m)
    pipes: dict[str, Any] = {}
    counts: dict[str, list[int]] = {}
    said: dict[str, list[str]] = {}
    same_as: dict[str, str] = {}
    for key, schedule, cut in builds:
        pipe, lines = build(name, schedule, cut, m, words, (x, y))
        counts[key], said[key] = [len(r) for r in pipe.layer_ranges], lines
        twin = next((k for k in pipes if k.split()[0] == schedule and counts[k] == counts[key]), None)
        if twin is None:
            pipes[key] = pipe
        else:
            same_as[key] = twin
            del pipe
    steps_of = in_turn(pipes, x, y, steps)
    for key, twin in same_as.items():
        steps_of[key] = steps_of[twin]
    return {"steps": steps_of, "counts": counts, "same_as": same_as, "words": said}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import stagewise as sw

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    words = Words()
    logger = logging.getLogger(WORD_LOGGER)
    logger.addHandler(words)
    logger.propagate = False
    out: dict[str, Any] = {}
    if args.headline:
        builds = [("zb-v default", "zb-v", "default"), ("1f1b default", "1f1b", "default")]
        builds += [(f"zb-v {c}", "zb-v", c) for c in ("default+sample", *NAMED)]
        builds += [("1f1b default+sample", "1f1b", "default+sample")]
        out["headline"] = measure("headline", builds, args.steps, args.microbatches, words)
    for name in [] if args.headline else args.workloads:
        for schedule in args.schedules or sw.schedule_names(synchronous=True):
            try:
                builds = [(f"{schedule} {cut}", schedule, cut) for cut in CUTS]
                out[f"{name} {schedule}"] = measure(name, builds, args.steps, args.microbatches, words)
            except ValueError as err:  # too few layers for the schedule's stages
                out[f"{name} {schedule}"] = {"refused": str(err)}
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "defaults.json").write_text(json.dumps({"results": out, "load": os.getloadavg()}))
        text = headline_table(out["headline"]) if args.headline else table(out)
        (args.out / "defaults.md").write_text(text)
        print(text)
    dist.destroy_process_group()


def _steps(row: dict[str, Any], cut: str, schedule: str | None = None) -> list[float]:
    """A cut's steps in a row of either format (this one's keys are "SCHEDULE CUT", the first run's "CUT")."""
    steps: dict[str, list[float]] = row["steps"]
    return steps.get(cut) or steps[f"{schedule} {cut}"]


def _counts(row: dict[str, Any], cut: str, schedule: str) -> list[int]:
    counts: dict[str, list[int]] = row["counts"]
    return counts.get(cut) or counts[f"{schedule} {cut}"]


def compare(row: dict[str, Any], schedule: str, cut: str) -> tuple[str, Ratio, str]:
    """``cut`` against the best named cut of the row (least median): that cut, the ratio, the verdict."""
    best = min(NAMED, key=lambda c: statistics.median(_steps(row, c, schedule)))
    ratio = paired_ratio(_steps(row, cut, schedule), _steps(row, best, schedule))
    same = _counts(row, cut, schedule) == _counts(row, best, schedule)
    return best, (Ratio(1.0, 1.0, 1.0) if same else ratio), ratio.verdict(same_cut=same)


def table(out: dict[str, Any]) -> str:
    """Per row: each default over the best named cut (interval, verdict), the schedule over 1F1B with defaults
    (unpaired interval: the rows were not timed in turn), the word the builds said, the cuts."""
    rows = [
        "| workload, schedule | default / best [90 %] | verdict | default+sample / best [90 %] | verdict | best of "
        "| vs 1F1B (default) [90 %] | spread | word (predicted / 1F1B) | cuts: default / +sample / best |",
        "|---|---:|---|---:|---|---|---:|---:|---|---|",
    ]
    for key, row in out.items():
        if "steps" not in row:
            rows.append(f"| {key} | refused | | | | | | | | {row['refused'][:60]} |")
            continue
        workload_name, schedule = key.split()
        best, plain, plain_says = compare(row, schedule, "default")
        _, sampled, sampled_says = compare(row, schedule, "default+sample")
        base = out.get(f"{workload_name} 1f1b", {})
        vs = "1.000" if schedule == "1f1b" else ""
        if "steps" in base and schedule != "1f1b":
            vs = paired_ratio(_steps(row, "default", schedule), _steps(base, "default", "1f1b"), unpaired=True).text()
        word = "; ".join(
            f"{cut}: {', '.join(_predicted(line) for line in said)}"
            for cut in CUTS
            if (said := _words(row, cut, schedule))
        )
        cuts = " / ".join(str(_counts(row, c, schedule)) for c in ("default", "default+sample", best))
        rows.append(
            f"| {key} | {plain.text()} | {plain_says} | {sampled.text()} | {sampled_says} | {best} | {vs} "
            f"| {spread(_steps(row, 'default', schedule)):.1%} | {word} | {cuts} |"
        )
    return "\n".join(rows) + "\n"


def _words(row: dict[str, Any], cut: str, schedule: str) -> list[str]:
    said: dict[str, list[str]] = row.get("words", {})
    return said.get(f"{schedule} {cut}", [])


def _predicted(line: str) -> str:
    """The predicted ratio a warning names ("... is predicted 1.23x 1F1B's step ...")."""
    return line.split("is predicted ")[1].split(" ")[0] if "is predicted " in line else line[:40]


def headline_table(row: dict[str, Any]) -> str:
    """The issue's GPT: ZB-V with defaults against 1F1B with defaults, and against ZB-V's best named cut."""
    med = {k: statistics.median(s) for k, s in row["steps"].items()}
    best = min((f"zb-v {c}" for c in NAMED), key=lambda k: med[k])
    lines = [
        "| comparison (the issue's GPT, 2 ranks, m 8) | ratio of medians [90 %] | verdict | cuts |",
        "|---|---:|---|---|",
    ]
    pairs = [
        ("zb-v default", "1f1b default"),
        ("zb-v default+sample", "1f1b default+sample"),
        ("zb-v default", best),
        ("zb-v default+sample", best),
        (best, "1f1b default"),
    ]
    for a, b in pairs:
        r = paired_ratio(row["steps"][a], row["steps"][b])
        same = row["counts"][a] == row["counts"][b] and a.split()[0] == b.split()[0]
        lines.append(
            f"| {a} / {b} | {r.text()} | {r.verdict(same_cut=same)} | {row['counts'][a]} / {row['counts'][b]} |"
        )
    lines.append("")
    lines.append("| pipeline | median step (ms) | spread | steps | warnings at build |")
    lines.append("|---|---:|---:|---:|---|")
    for k, s in row["steps"].items():
        said = row["words"].get(k, [])
        lines.append(
            f"| {k} | {med[k] * 1e3:.1f} | {spread(s):.1%} | {len(s)} | {len(said)}: {said[0] if said else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/defaults"))
    parser.add_argument("--workloads", nargs="+", default=["gpt64", "gpt256", "resnet", "mlp"])
    parser.add_argument("--schedules", nargs="*", default=None, help="default: every synchronous schedule")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="timed steps per pipeline, taken in turn")
    parser.add_argument("--headline", action="store_true", help="the issue's GPT: zb-v and 1f1b, defaults and named")
    parser.add_argument("--quick", action="store_true", help="gpt64, 1f1b and zb-v, 3 steps")
    parser.add_argument("--report", type=Path, default=None, help="print the table of a saved defaults.json")
    args = parser.parse_args(argv)
    if args.report is not None:
        saved = json.loads(args.report.read_text())["results"]
        print(headline_table(saved["headline"]) if "headline" in saved else table(saved))
        return 0
    if args.quick:
        args.workloads, args.schedules, args.steps = ["gpt64"], ["1f1b", "zb-v"], 3
    if launched():
        rank_main(args)
        return 0
    return on_ranks(2, "benchmarks.defaults", sys.argv[1:] if argv is None else argv, OMP_NUM_THREADS="1")


if __name__ == "__main__":
    sys.exit(main())
