"""An elastic job of ``stagewise run --nnodes MIN:MAX`` on namespace machines, driven step by step from outside.

For tests/system/test_elastic.py, test_elastic_faults.py and benchmarks/elastic.py: :class:`Job` starts
tests/system/scripts/elastic_train.py on machines of :mod:`helpers.netns` (machine 0 hosts the rendezvous
store unless ``store`` names another endpoint), waits for the markers the script leaves at its hold
points, loses machines, starts them again, and reads what the job wrote.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_train as et
import stagewise as sw
from helpers import netns

#: fast enough for tests: a dead machine's keep-alive expires after 3 s, a round closes 2 s after MIN joined
FAST_RDZV = "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class Job:
    """One elastic job of ``nnodes`` machines (``MIN:MAX``) of ``nproc`` processes each."""

    machines: netns.Machines
    out: Path
    script: list[str]
    nnodes: str = "2:3"
    nproc: int = 2
    port: int = 29530
    rdzv_conf: str = FAST_RDZV
    restarts: int = 3
    store: str | None = None  # another endpoint (``stagewise rendezvous``): then no machine hosts the store
    started: dict[int, float] = field(default_factory=dict)

    def run_args(self, i: int) -> list[str]:
        endpoint = self.store or f"{self.machines.addr(0)}:{self.port}"
        args = ["-n", str(self.nproc), "--nnodes", self.nnodes, "--max-restarts", str(self.restarts)]
        args += ["--rdzv-endpoint", endpoint, "--rdzv-id", "elastic-test", "--rdzv-conf", self.rdzv_conf]
        args += ["--local-addr", self.machines.addr(i)]
        args += ["--rdzv-host"] if i == 0 and self.store is None else []
        return [*args, et.__file__, "--out", str(self.out), *self.script]

    def host_store(self, i: int) -> str:
        """Machine ``i`` runs ``stagewise rendezvous`` only (no workers); its endpoint, for ``store``."""
        self.machines.start(
            i, ["--host", self.machines.addr(i), "--port", str(self.port)], self.log(i), command="rendezvous"
        )
        return f"{self.machines.addr(i)}:{self.port}"

    def workers_gone(self, i: int) -> bool:
        """Whether machine ``i`` runs its agent alone (its workers exited: the agent is meeting the others)."""
        return len(netns.pids(self.machines.name(i))) == 1

    def log(self, i: int) -> Path:
        return self.out / f"machine{i}.log"

    def start(self, *which: int) -> None:
        for i in which:
            self.started[i] = time.time()
            self.machines.start(i, self.run_args(i), self.log(i))

    def lose(self, *which: int) -> float:
        """SIGKILL every process of these machines; when."""
        return max(self.machines.kill(i) for i in which)

    def tails(self) -> str:
        parts = []
        for i in range(self.machines.n):
            text = self.log(i).read_text(errors="replace") if self.log(i).exists() else "(no log)"
            parts.append(f"--- machine {i} ---\n{text[-5000:]}")
        return "\n".join(parts)

    def wait_markers(self, prefix: str, count: int, timeout: float = 400) -> None:
        """Until ``count`` ranks have left the marker ``prefix-r<rank>`` (elastic_train.py's holds and stalls)."""

        def reached() -> bool:
            if len(list(self.out.glob(f"{prefix}-r*"))) >= count:
                return True
            if self.machines.jobs and all(j[-1].poll() is not None for j in self.machines.jobs.values()):
                pytest.fail(f"every machine ended before {count} ranks reached {prefix}\n{self.tails()}")
            return False

        netns.wait_for(f"{count} ranks at {prefix}", reached, timeout, self.tails)

    def release(self, name: str) -> None:
        (self.out / name).touch()

    def exits(self, which: list[int], timeout: float = 400) -> list[int | None]:
        """The exit status of each machine's latest start (None: still running after ``timeout`` in all)."""
        deadline = time.monotonic() + timeout
        return [self.machines.wait(i, max(deadline - time.monotonic(), 0.1)) for i in which]

    def rows(self, name: str) -> list[dict[str, Any]]:
        path = self.out / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        return "\n".join(
            self.log(i).read_text(errors="replace") for i in range(self.machines.n) if self.log(i).exists()
        )


def no_abort(job: Job) -> None:
    """No process of the job aborted (SIGABRT, "terminate called") or dumped a core."""
    text = job.logs()
    for sign in ("terminate called", "core dumped", "Aborted", "SIGABRT", "Fatal Python error"):
        assert sign not in text, f"{sign!r} in the logs:\n{job.tails()}"


def state(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model and AdamW state by one-process name (``model/NAME``, ``optim/NAME/KEY``)."""
    model = sw.build_model(et.layers())
    opt = et.adamw(list(model.parameters()))
    sw.checkpoint.load(folder, model, opt, collective=False)
    out = {f"model/{n}": t.detach().clone() for n, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, entries in opt.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": torch.as_tensor(v).clone() for k, v in entries.items()})
    return out


def traced(folder: Path) -> dict[str, torch.Tensor]:
    """The union of the ranks' dumps at a step (elastic_train.py --trace); replicas must agree."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("rank-*.pt")):
        for name, t in torch.load(path, weights_only=True).items():
            assert name not in out or torch.equal(out[name], t), (path, name)
            out[name] = t
    return out


def same_state(resumed: Path, trace: Path) -> None:
    """The state a resume saved equals, to the bit, what the ranks had at that step (every tensor named)."""
    got, want = state(resumed), traced(trace)
    assert sorted(got) == sorted(want) and any("/exp_avg" in k for k in want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
