"""Bad input at 4 ranks: does every rank stop with a clear error, naming what is at fault, and how soon?

    .venv/bin/python -m benchmarks.bad_input [--cases NAME ...] [--timeout 10]

Each case is one torchrun job of 4 gloo ranks (``sw.init(timeout=...)``) making one mistake a user makes:
a misspelt option, an unknown schedule, fewer samples than micro-batches, a partition that does not
add up, a layout that does not fit the world, too few layers for the stages, a layer fed the wrong width,
targets of the wrong shape, ``from_stages`` given a count, ``schedule="auto"`` without sample inputs, a
loss that is not a scalar, and one rank built with other options than the rest. Every rank writes the
first line of the error it ended with. A case passes when every rank exits non-zero and every rank's line
names what the case expects (the option, or the rank at fault; the rank where a layer or the loss failed
raises that error as it is). Prints one row per case with the
job's wall time (torch's import and the launcher included); the times are measured, never judged.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._launch import environ, launched, torchrun

WORLD = 4


def _layers(widths: tuple[int, ...] = (8, 16, 16, 16, 16, 16, 16, 2)) -> list:
    from torch import nn

    return [nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]


def _data(batch: int = 8, width: int = 8, classes: int = 2) -> tuple:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, width, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _train(**options: object) -> None:
    """A 7-layer MLP over the 4 ranks, one step on a batch of 8."""
    import torch.nn.functional as F

    import stagewise as sw

    x, y = _data(int(options.pop("batch", 8)))  # type: ignore[call-overload]
    layers = options.pop("layers", None) or _layers()
    pipe = sw.Pipeline(layers, loss_fn=options.pop("loss_fn", F.cross_entropy), **options)
    pipe.train_step(x, y)


def _wrong_targets() -> None:
    import torch
    import torch.nn.functional as F

    import stagewise as sw

    x, _ = _data()
    pipe = sw.Pipeline(_layers(), loss_fn=F.cross_entropy, microbatches=4)
    pipe.train_step(x, torch.zeros(8, 3))  # class probabilities for 3 classes; the head has 2


def _wrong_width() -> None:
    from torch import nn

    layers = _layers()
    layers[5] = nn.Linear(12, 16)  # fed 16 features by the layer before it
    _train(layers=layers, partition=[2, 2, 2, 1])  # layer 5 is on rank 2


def _rank_differs() -> None:
    import torch.distributed as dist

    _train(microbatches=2 if dist.get_rank() == 2 else 4)


def _from_stages_count() -> None:
    import torch.nn.functional as F

    import stagewise as sw

    sw.Pipeline.from_stages(4, loss_fn=F.cross_entropy)  # type: ignore[arg-type]


def _parallel_mismatch() -> None:
    import stagewise as sw

    _train(parallel=sw.ParallelConfig(pp=2, dp=3))


def _not_a_scalar() -> None:
    import torch.nn.functional as F

    _train(loss_fn=lambda out, y: F.cross_entropy(out, y, reduction="none"), microbatches=4)


#: name -> (what the ranks run, words every rank's line must hold). A case that fails on one rank alone
#: (a layer's or the loss's own error, which that rank raises as it is) expects the others to name that rank:
#: :data:`VICTIMS`.
CASES: dict[str, tuple[Callable[[], None], tuple[str, ...]]] = {
    "misspelt option": (lambda: _train(microbatchs=4), ("microbatchs", "microbatches")),
    "unknown schedule": (lambda: _train(schedule="1f1c"), ("1f1c", "1f1b")),
    "fewer samples than micro-batches": (lambda: _train(batch=2, microbatches=4), ("2", "4", "micro")),
    "partition does not add up": (lambda: _train(partition=[2, 2, 2, 2]), ("partition", "7")),
    "layout does not fit the world": (_parallel_mismatch, ("pp=2", "dp=3", "4")),
    "too few layers": (lambda: _train(layers=_layers((8, 16, 2))), ("layers", "stages")),
    "a layer fed the wrong width": (_wrong_width, ("rank 2",)),
    "targets of the wrong shape": (_wrong_targets, ("rank 3",)),
    "from_stages given a count": (_from_stages_count, ("from_stages", "stages")),
    "schedule='auto' without sample inputs": (lambda: _train(schedule="auto"), ("auto", "sample_inputs")),
    "loss not a scalar": (_not_a_scalar, ("loss", "scalar")),
    "one rank with other options": (_rank_differs, ("rank 2", "microbatches")),
}
#: the rank that fails on its own in a case (its line is its own error; it must only have one)
VICTIMS = {"a layer fed the wrong width": 2, "targets of the wrong shape": 3, "loss not a scalar": 3}


def rank_main(case: str, out: Path, timeout: float) -> None:
    """One rank of a case: run it, write the first line of the error it ends with (or "no error")."""
    import stagewise as sw

    rank = int(os.environ["RANK"])
    line, code = "no error", 0
    try:
        sw.init(backend="gloo", timeout=timeout)
        CASES[case][0]()
    except Exception as err:  # the error the user would read first
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        line, code = f"{type(err).__name__}: {first}", 1
    (out / f"rank{rank}.txt").write_text(line)
    # torchrun ends every worker once one has exited with an error: wait (bounded) until every rank has written
    # its line, so that a rank a little behind is judged on its own error, not on being ended
    deadline = time.monotonic() + 3 * timeout
    while time.monotonic() < deadline and len(list(out.glob("rank*.txt"))) < WORLD:
        time.sleep(0.05)
    os._exit(code)  # the line is what is judged; skip the exit hook's traceback


def run_case(case: str, timeout: float) -> tuple[bool, float, list[str], list[str]]:
    """(passed, wall seconds, every rank's line, problems)."""
    with tempfile.TemporaryDirectory(prefix="sw-bad-") as tmp:
        out = Path(tmp)
        cmd = torchrun(WORLD, "benchmarks.bad_input", ["--rank-case", case, "--out", tmp, "--timeout", str(timeout)])
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=environ(OMP_NUM_THREADS="1"), capture_output=True, timeout=3 * timeout + 60)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        took = time.perf_counter() - start
        lines = [
            (out / f"rank{r}.txt").read_text() if (out / f"rank{r}.txt").exists() else "(nothing)" for r in range(4)
        ]
    words = CASES[case][1]
    problems = []
    if code is None:
        problems.append("hung")
    elif code == 0:
        problems.append("the job succeeded")
    for r, line in enumerate(lines):
        missing = [] if VICTIMS.get(case) == r else [w for w in words if w not in line]
        if line in ("(nothing)", "no error") or missing:
            problems.append(f"rank {r}: {line[:160]!r} lacks {missing}")
    return not problems, took, lines, problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="NAME")
    parser.add_argument("--timeout", type=float, default=10.0, help="the pipelines' timeout (seconds)")
    parser.add_argument("--rank-case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if launched():
        rank_main(args.rank_case, args.out, args.timeout)
        return
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    print("| case | clear on every rank | wall s | rank 0's line |\n|---|---|---:|---|")
    passed = 0
    for case in args.cases:
        ok, took, lines, problems = run_case(case, args.timeout)
        passed += ok
        print(f"| {case} | {'yes' if ok else 'NO'} | {took:.1f} | {lines[0][:150]} |", flush=True)
        for p in problems:
            print(f"    {p}", file=sys.stderr)
    print(f"\n{passed} of {len(args.cases)} cases: a clear error on every rank")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
