"""Start a module of multi-process checks once, under torchrun, and read back one result per check and rank.

The pytest side of tests/distributed/: the ranks run ``tests/distributed/workers/worker.py``, which imports the
module of checks beside it (the ranks find ``helpers`` through PYTHONPATH, set from pytest's ``pythonpath``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "workers" / "worker.py"

__all__ = [
    "TRANSPORTS",
    "SuiteResults",
    "run_suite",
    "selected",
    "suite_per_transport",
    "suites_by_ranks",
]

#: STAGEWISE_TRANSPORT values the runtime suites run under, and the transport class each must give
TRANSPORTS = {"torch": "TorchTransport", "shm": "ShmTransport"}


@dataclass
class SuiteResults:
    nprocs: int
    by_check: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    log: str = ""
    transport: str | None = None  # the STAGEWISE_TRANSPORT the job ran under

    def get(self, name: str) -> dict[int, dict[str, Any]]:
        """The check's row on every rank; fails the test naming the ranks that failed or never reported."""
        ranks = self.by_check.get(name, {})
        missing = [r for r in range(self.nprocs) if r not in ranks]
        if missing:
            pytest.fail(f"check {name!r} has no result from ranks {missing}; worker log tail:\n{self.log[-6000:]}")
        failed = {r: res["detail"] for r, res in sorted(ranks.items()) if not res["ok"]}
        if failed:
            pytest.fail("\n".join(f"--- rank {r} ---\n{detail}" for r, detail in failed.items()))
        return ranks

    def assert_ok(self, name: str) -> None:
        self.get(name)

    def assert_transport(self) -> None:
        """Every rank's pipelines got the transport STAGEWISE_TRANSPORT named (the check ``transport-in-use``)."""
        assert self.transport is not None, "the suite ran without STAGEWISE_TRANSPORT"
        got = {r: row["info"]["transport"] for r, row in self.get("transport-in-use").items()}
        assert got == dict.fromkeys(range(self.nprocs), TRANSPORTS[self.transport]), (self.transport, got)


def run_suite(
    module: str,
    nprocs: int,
    out: Path,
    timeout: float,
    *,
    suite: str | None = None,
    env: dict[str, str] | None = None,
    only: list[str] | None = None,
) -> SuiteResults:
    """Run the checks of tests/distributed/workers/``module``.py on ``nprocs`` gloo ranks in one bounded torchrun job.

    ``only``: the checks to run (all when None), e.g. :func:`selected` for ``pytest -k``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    cmd += ["--max-restarts=0", str(WORKER), "--checks", module, "--out", str(out)]
    if suite is not None:
        cmd += ["--suite", suite]
    if only is not None:
        cmd += ["--only", ",".join(only)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env or {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        log = f"torchrun timed out after {timeout} s\n{err.stdout or ''}{err.stderr or ''}"
    results = SuiteResults(nprocs, log=log if isinstance(log, str) else log.decode(errors="replace"))
    results.transport = (env or {}).get("STAGEWISE_TRANSPORT")
    for rank in range(nprocs):
        path = out / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            results.by_check.setdefault(row["check"], {})[rank] = row
    return results


def selected(request: pytest.FixtureRequest, ranks: int | None = None) -> list[str] | None:
    """The check names the session's selected tests of this module ask for (``pytest -k`` runs only those).

    Tests name their check in a ``name`` parameter (and a ``ranks`` one where a module runs several rank
    counts); None when a selected test of the module names none (then every check runs).
    """
    names: list[str] = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "name" not in params:
            return None
        if ranks is None or params.get("ranks", ranks) == ranks:
            names.append(params["name"])
    return sorted(set(names))


def suites_by_ranks(module: str, label: str, timeout: float) -> Any:
    """A module-scoped fixture: ``suites(ranks)`` runs ``module``'s checks on that many ranks once, then reuses it.

    For test modules that run the same checks at several rank counts (one torchrun job per count).
    """

    @pytest.fixture(scope="module")
    def suites(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
        done: dict[int, SuiteResults] = {}

        def get(ranks: int) -> SuiteResults:
            if ranks not in done:
                out = tmp_path_factory.mktemp(f"{label}{ranks}")
                done[ranks] = run_suite(module, ranks, out, timeout=timeout, only=selected(request, ranks))
            return done[ranks]

        return get

    return suites


def suite_per_transport(module: str, ranks: int, suite: str, timeout: float) -> Any:
    """A module-scoped fixture ``results``: ``module``'s ``suite`` on ``ranks`` ranks, one torchrun job per
    transport (TRANSPORTS, by STAGEWISE_TRANSPORT), its check ``transport-in-use`` always run."""

    @pytest.fixture(scope="module", params=list(TRANSPORTS))
    def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
        only = selected(request)
        return run_suite(
            module,
            ranks,
            tmp_path_factory.mktemp(f"{module}{ranks}-{request.param}"),
            timeout=timeout,
            suite=suite,
            env={"STAGEWISE_TRANSPORT": request.param},
            only=None if only is None else [*only, "transport-in-use"],
        )

    return results
