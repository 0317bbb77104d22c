"""Two minutes of chaos (``make elastic``; ``make chaos`` is the ten-minute benchmark): a seeded schedule of losses
and returns on three namespace machines under the elastic guide's command, and what must hold whatever the
times: every event absorbed before the next, in order (the harness waits for each before the next is due: on
a loaded machine the two minutes stretch); every run of the job equal, bit for bit in float64, to
a fresh job of its size replayed from the same step; the final lineage whole (no step missing, no sample
skipped or seen twice, no row from a superseded run) and equal to the one-process model's to rounding.

Times (recovery, goodput) are the benchmark's: ``python -m benchmarks.recovery chaos`` (docs/benchmarks/
recovery.md). Needs root (``ip netns``); skipped in ``make test``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import chaos_harness as ch
import elastic_train as et
import recovery_log as rl
import stagewise as sw
from elastic_harness import no_abort
from helpers import models as mdl
from helpers import netns

pytestmark = [
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not os.environ.get("STAGEWISE_ELASTIC"), reason="two minutes of chaos: `make elastic`"),
]

SEED, DURATION, INTERVAL = 43, 120.0, 40.0


@pytest.mark.parametrize("path", ["restart", "inplace"])
def test_two_minutes_of_chaos(path: str, tmp_path: Path) -> None:
    """``restart``: the guide's command (torch's agent restarts the survivors); ``inplace``: ``sw.runtime.InPlace``
    under ``stagewise run --in-place`` - the survivors keep their processes and the machine back joins them."""
    plan = rl.schedule(SEED, DURATION, INTERVAL)
    assert [k for _, k, _ in plan] == ["kill", "back"]
    script = ["--every", "1", "--timeout", "10", "--start-world", "6", "--keep-resumed"]
    script += ["--inplace"] if path == "inplace" else []
    extra = ["--in-place", "--rdzv-conf", "last_call_timeout=60"] if path == "inplace" else []
    with netns.make(f"cz{os.getpid() % 1000}", 4, subnet=os.getpid() % 100 + 140) as machines:
        job = ch.GuideJob(machines, tmp_path, script, port=29580, restarts=len(plan) + 5, extra=extra)
        faults, began, ended = ch.chaos(job, plan, DURATION, absorb=600, wake=path == "inplace")
    rows = faults.rows()
    nexts = [e.at for e in faults.events[1:]] + [ended]
    costs = [rl.incident(rows, e, until) for e, until in zip(faults.events, nexts, strict=True)]
    assert all(c["recovered"] for c in costs), (costs, job.tails())
    worlds = [w for i, w in enumerate(r["world"] for r in rows) if i == 0 or rows[i - 1]["world"] != w]
    assert worlds == [6, 4, 6], worlds  # in the schedule's order, nothing else
    assert [r["world"] for r in job.rows("resumes.jsonl")] == [4, 6]
    assert {r["source"] for r in job.rows("resumes.jsonl")} == {"snapshots"}
    # nothing the runtime called committed (pipe.committed_step, each row's "committed") is trained again
    assert all(c["rolled_back"] == 0 and c["skipped"] == c["twice"] == 0 for c in costs), costs
    line = rl.lineage(rows)
    assert rl.samples_check(line) == {"missing_steps": 0, "skipped": 0, "twice": 0}
    assert rl.stale_rows(rows) == 0
    replayed = ch.replay(tmp_path, rows, job.rows("resumes.jsonl"), limit=20)
    assert len(replayed) == 3 and all(r["replayed"] and not r["differ"] for r in replayed), replayed
    one_process(line)
    no_abort(job)


def one_process(line: dict[int, rl.Row]) -> None:
    """The lineage's losses are the one-process float64 model's, step for step, to rounding (rtol 1e-10)."""
    model = sw.build_model(et.layers(), seed=et.SEED)
    opt = et.adamw(list(model.parameters()))
    want = []
    for step in sorted(line):
        x, y = mdl.lm_data(et.LAYOUT.batch, seed=100 + step)
        loss = mdl.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    got = torch.tensor([line[s]["loss"] for s in sorted(line)], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=0)
