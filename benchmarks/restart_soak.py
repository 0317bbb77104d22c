"""Restart soak: one job SIGKILLed on N attempts in a row under ``stagewise run --max-restarts N``.

    .venv/bin/python -m benchmarks.restart_soak                 # 30 kills, 40 steps, a checkpoint every 2
    .venv/bin/python -m benchmarks.restart_soak --kills 50 --seed 1

The kill plan is drawn from ``--seed``: on attempt a, rank 0 or 1 kills itself
before a step, in the middle of one, or after writing its share of a
checkpoint (tests/system/scripts/restart_train.py, run with pytest's module
path), always after the checkpoint that attempt resumes from. An uninterrupted job of the same script runs first. The
soak passes when the killed job used every attempt (N + 1), exited 0, and
ended with the same losses, parameters and AdamW state, bit for bit. Printed:
attempts, wall time of both jobs, and the seconds each restart cost.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._launch import with_the_tests


def plan(kills: int, steps: int, every: int, seed: int) -> list[tuple[int, int, str]]:
    """(rank, step, when) per attempt; each step lies after the newest checkpoint complete at that point."""
    rng = random.Random(seed)
    resume, out = 0, []
    for _ in range(kills):
        step = rng.randint(resume + 1, min(resume + 2 * every, steps))
        when = rng.choice(["before", "mid", "save"])
        if when == "save" and step % every and step != steps:
            when = "mid"
        out.append((rng.randint(0, 1), step, when))
        resume = max((s for s in range(every, step, every)), default=0)  # checkpoints before the killed step
    return out


def job(out: Path, steps: int, every: int, kills: list[tuple[int, int, str]]) -> tuple[int, float]:
    spec = ",".join(f"{a}:{r}:{s}:{w}" for a, (r, s, w) in enumerate(kills))
    import restart_train

    cmd = [sys.executable, "-m", "stagewise.cli", "run", "-n", "2", "--max-restarts", str(len(kills))]
    cmd += [restart_train.__file__, "--out", str(out), "--steps", str(steps), "--save-every", str(every)]
    cmd += ["--kills", spec]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    started = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600).returncode
    return code, time.perf_counter() - started


def final(folder: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    import restart_train
    import stagewise as sw

    model = sw.build_model(restart_train.layers())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    info = sw.checkpoint.load(folder / "ckpt", model, opt, collective=False)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        tensors.update({f"optim{i}/{k}": torch.as_tensor(v) for k, v in st.items()})
    return info.extra["losses"], tensors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with_the_tests("benchmarks.restart_soak", "restart_train")
    kills = plan(args.kills, args.steps, args.save_every, args.seed)
    with tempfile.TemporaryDirectory(prefix="sw-restart-soak-") as tmp:
        root = Path(tmp)
        code0, plain_s = job(root / "plain", args.steps, args.save_every, [])
        code1, killed_s = job(root / "killed", args.steps, args.save_every, kills)
        if code0 or code1:
            print(f"FAILED: exit codes {code0} (uninterrupted) and {code1} (killed)")
            print((root / "killed.log").read_text()[-4000:])
            return 1
        attempts = len({f.name.split("-")[0] for f in (root / "killed" / "attempts").iterdir()})
        plain_losses, plain_t = final(root / "plain")
        killed_losses, killed_t = final(root / "killed")
        same = plain_losses == killed_losses and all(torch.equal(plain_t[k], killed_t[k]) for k in plain_t)
    kinds = {w: sum(1 for _, _, x in kills if x == w) for w in ("before", "mid", "save")}
    print(f"kills: {len(kills)} ({kinds}), attempts used: {attempts} of {len(kills) + 1}")
    print(f"uninterrupted job: {plain_s:.1f} s; killed job: {killed_s:.1f} s")
    print(f"per restart: {(killed_s - plain_s) / max(1, len(kills)):.2f} s (start, resume, replayed steps)")
    print(f"final losses, parameters and AdamW state bit-exact: {same}")
    return 0 if same and attempts == len(kills) + 1 else 1


if __name__ == "__main__":
    sys.exit(main())
