"""What splitting the backward costs on a measured GPT, and what the synthesizer makes of it (B charged as B).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.synthesis.backward
        [--d-model 256 --layers 8 --heads 4 --seq 64 --vocab 512 --batch 2] [--ranks 2] [--microbatches 8]
        [--rounds 3] [--profile FILE] [--save FILE]

One process, one thread: profiles the demo GPT's layers (``examples/gpt_model.py``: pre-norm blocks, tied head,
float32; by default the issue's d 256 model, 8 blocks, 4 heads, 64 tokens, vocabulary 512, micro-batches of 2
sequences), each layer from the fastest of ``--rounds`` rounds (or reads ``--profile``), and cuts it by time into
``--ranks`` stages (and twice as many for ZB-V). Prints, per stage, F, I, W, B and (I + W) / B, the forward's
saved bytes and the bytes W holds after I (its share of them); then the simulated step and activation peak of
1F1B, ZB-H1 and ZB-V with the measured costs, beside the old cost model's (I + W scaled to B); then the
synthesized schedule under 1F1B's memory (min(p, m) micro-batches): its step, the registered schedules it was
measured against (each as it runs: 1F1B with B), the stages it runs whole, its B actions, the lower bound.
Simulated times: no pipeline is run (``benchmarks.vs_one_process`` and the fidelity benchmark measure them).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

from stagewise.partition import LayerProfile, partition_costs
from stagewise.schedules import generate
from stagewise.simulation import CostModel, simulate
from stagewise.synthesis import report_of, synthesize


def measured(args: argparse.Namespace) -> LayerProfile:
    """The profile: read from ``--profile``, or measured now (and saved to ``--save``)."""
    if args.profile is not None:
        return LayerProfile.from_json(args.profile.read_text())
    import torch

    from .._examples import example
    from .measure import gpt_profile

    torch.set_num_threads(1)
    gm = example("gpt_model")
    cfg = gm.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers
    )
    prof = gpt_profile(rounds=args.rounds, config=cfg, batch=args.batch)
    if args.save is not None:
        args.save.write_text(prof.to_json() + "\n")
    return prof


def cut(prof: LayerProfile, stages: int) -> tuple[CostModel, CostModel]:
    """The time-balanced cut into ``stages``: the cost model as measured, and as the old one scaled I + W to B."""
    bounds = partition_costs(prof.times(), stages).bounds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = prof.cost_model(bounds, match_backward=True)
    return prof.cost_model(bounds), old


def stage_table(costs: CostModel) -> str:
    out = [
        "| stage | F ms | I ms | W ms | B ms | (I + W) / B | saved by F | held by W | W's share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in range(costs.num_stages):
        f, i, w, b = costs.forward[s], costs.backward_input[s], costs.backward_weight[s], costs.backward(s)
        act, held = costs.activation_bytes[s], costs.weight_activation_bytes[s]
        out.append(
            f"| {s} | {f * 1e3:.3f} | {i * 1e3:.3f} | {w * 1e3:.3f} | {b * 1e3:.3f} | {(i + w) / b:.3f} "
            f"| {act / 2**20:.2f} MiB | {held / 2**20:.2f} MiB | {held / act:.0%} |"
        )
    return "\n".join(out)


def schedule_table(prof: LayerProfile, p: int, m: int) -> str:
    out = [
        "| schedule | step ms (measured costs) | step ms (I + W scaled to B) | peak MiB (rank 0) |",
        "|---|---:|---:|---:|",
    ]
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("zb-v", 2)):
        costs, old = cut(prof, p * v)
        schedule = generate(name, p, m, v)
        now, then = simulate(schedule, costs), simulate(schedule, old)
        out.append(
            f"| {name} | {now.makespan * 1e3:.2f} | {then.makespan * 1e3:.2f} "
            f"| {now.peak_activation_bytes[0] / 2**20:.2f} |"
        )
    return "\n".join(out)


def synthesis_report(prof: LayerProfile, p: int, m: int, v: int) -> str:
    costs, _ = cut(prof, p * v)
    got = report_of(synthesize(costs, p, m, memory=min(p, m), virtual_stages=v))
    hand = ", ".join(f"{k} {t * 1e3:.2f}" for k, t in sorted(got.hand_written.items(), key=lambda kv: kv[1]))
    hand = hand or "none under this cap"
    whole = ", ".join(map(str, got.whole_stages)) or "none"
    return (
        f"v = {v}: synthesized {got.makespan * 1e3:.2f} ms against {got.baseline} {got.baseline_makespan * 1e3:.2f} "
        f"({(got.makespan / got.baseline_makespan - 1) * 100:+.1f} %), lower bound {got.lower_bound * 1e3:.2f}; "
        f"stages run whole: {whole}; B actions: {got.b_actions} of {p * v * m}\n"
        f"  registered schedules that fit (ms): {hand}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="profile rounds, each layer from its fastest")
    parser.add_argument("--profile", type=Path, default=None, help="read this profile (LayerProfile JSON)")
    parser.add_argument("--save", type=Path, default=None, help="write the profile measured here")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    prof = measured(args)
    p, m = args.ranks, args.microbatches
    batch = prof.batch or (args.batch if args.profile is None else "?")
    print(f"\n{len(prof)} layers, micro-batch of {batch} sequences, {p} ranks, {m} micro-batches\n")
    print(stage_table(cut(prof, p)[0]))
    print()
    print(stage_table(cut(prof, 2 * p)[0]))
    print()
    print(schedule_table(prof, p, m))
    print()
    for v in (1, 2):
        print(synthesis_report(prof, p, m, v))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
