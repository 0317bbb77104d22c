"""The first train step and the first ``clip_grad_norm_`` import nothing (issue 17, the "first clip stall").

Both wait for other ranks under the pipeline's timeout: a module imported on a first call (torch's
tensor-parallel and FSDP packages in the clip; sympy, through ``torch.autograd.backward`` given output
gradients, in a stage's first backward) took seconds on a loaded machine, more on some ranks than on
others, and the ranks that came first waited past the timeout. So every module a step runs must already
be loaded with the Pipeline: checked in a fresh one-process job with two stages on the rank (so a stage's
backward is given its gradient), whose norm is also compared with torch's on the same model.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
import torch
import torch.nn.functional as F
from torch import nn
import stagewise as sw

sw.init("gloo")
f64 = torch.float64
layers = [sw.Layer(nn.Linear, 6, 5, dtype=f64), sw.Layer(nn.Tanh), sw.Layer(nn.Linear, 5, 3, dtype=f64)]
pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="interleaved-1f1b", microbatches=2, virtual_stages=2)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(4, 6, generator=g, dtype=f64), torch.randint(0, 3, (4,), generator=g)
before = set(sys.modules)
pipe.train_step(x, y)
norm = pipe.clip_grad_norm_(0.01)
print(sorted(set(sys.modules) - before))
model = sw.build_model(layers, seed=0)
F.cross_entropy(model(x), y).backward()
print(repr(norm), repr(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))))
"""


def test_first_step_and_clip_import_nothing_and_clip_matches_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported, norms = proc.stdout.strip().splitlines()[-2:]
    assert imported == "[]", f"the first step and clip imported modules: {imported[:500]}"
    ours, torchs = (float(v) for v in norms.split())
    assert abs(ours - torchs) <= 1e-12 * max(1.0, torchs), (ours, torchs)
