"""Start a module of multi-process checks once, under torchrun, and read back one result per check and rank.

The pytest side of tests/distributed/: the ranks run ``tests/distributed/workers/worker.py``, which imports the
module of checks beside it (the ranks find ``helpers`` through PYTHONPATH, set from pytest's ``pythonpath``).
Test modules that declare a :class:`Share` (``SHARE``) run their checks in one job between them (:func:`shared_job`):
a job's start (processes, torch, gloo) costs seconds of both cores, more than many a check.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).resolve().parents[1] / "distributed" / "workers" / "worker.py"

__all__ = [
    "TRANSPORTS",
    "Share",
    "SuiteResults",
    "run_suite",
    "selected",
    "shared_job",
    "shared_results",
    "shared_timeout",
    "shares_of",
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
            lines = [f"check {name!r} failed on ranks {sorted(failed)}"]
            pytest.fail("\n".join(lines + [f"--- rank {r} ---\n{detail}" for r, detail in failed.items()]))
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
    transports: list[str] | None = None,
) -> SuiteResults:
    """Run the checks of tests/distributed/workers/``module``.py on ``nprocs`` gloo ranks in one bounded torchrun job.

    ``only``: the checks to run (all when None), e.g. :func:`selected` for ``pytest -k``; ``transports``: each
    check once under each (named ``transport:check``; :func:`suite_per_transport`).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}"]
    cmd += ["--max-restarts=0", str(WORKER), "--checks", module, "--out", str(out)]
    if suite is not None:
        cmd += ["--suite", suite]
    if only is not None:
        cmd += ["--only", ",".join(only)]
    if transports is not None:
        cmd += ["--transports", ",".join(transports)]
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
    return _selected(request.session, request.module, ranks)


def _selected(session: pytest.Session, module: Any, ranks: int | None = None) -> list[str] | None:
    names: list[str] = []
    for item in session.items:
        if getattr(item, "module", None) is not module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "name" not in params:
            return None
        if ranks is None or params.get("ranks", ranks) == ranks:
            names.append(params["name"])
    return sorted(set(names))


def suites_by_ranks(
    module: str, label: str, timeout: float, *, suite: str | None = None, shared: tuple[Share, ...] = ()
) -> Any:
    """A module-scoped fixture: ``suites(ranks)`` runs ``module``'s checks on that many ranks once, then reuses it.

    For test modules that run the same checks at several rank counts (one torchrun job per count); a count that
    one of ``shared`` (the module's ``SHARE``) names reads its checks from that count's shared job instead.
    """

    @pytest.fixture(scope="module")
    def suites(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
        done: dict[int, SuiteResults] = {}

        def get(ranks: int) -> SuiteResults:
            if ranks not in done:
                share = next((s for s in shared if s.ranks == ranks), None)
                if share is not None:
                    done[ranks] = shared_results(request.session, tmp_path_factory, share)
                else:
                    out = tmp_path_factory.mktemp(f"{label}{ranks}")
                    only = selected(request, ranks)
                    done[ranks] = run_suite(module, ranks, out, timeout=timeout, suite=suite, only=only)
            return done[ranks]

        return get

    return suites


def suite_per_transport(module: str, ranks: int, suite: str, timeout: float, *, last: tuple[str, ...] = ()) -> Any:
    """A module-scoped fixture ``results``: ``module``'s ``suite`` on ``ranks`` ranks under each transport (TRANSPORTS,
    by STAGEWISE_TRANSPORT), its check ``transport-in-use`` always run. One torchrun job runs every check once per
    transport (the worker's ``--transports``: one process start for both), ``last`` (checks that leave receives
    behind) after all the others."""
    jobs: dict[str, SuiteResults] = {}

    @pytest.fixture(scope="module", params=list(TRANSPORTS))
    def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
        if request.param not in jobs:
            jobs.update(_per_transport(request, tmp_path_factory, module, ranks, suite, timeout, last))
        return jobs[request.param]

    return results


def _per_transport(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    module: str,
    ranks: int,
    suite: str,
    timeout: float,
    last: tuple[str, ...],
) -> dict[str, SuiteResults]:
    asked = {
        getattr(item, "callspec", None) and item.callspec.params.get("results")
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    }
    transports = [t for t in TRANSPORTS if t in asked] or list(TRANSPORTS)
    only = selected(request)
    names = list(importlib.import_module(module).checks(ranks, suite)) if only is None else [*only, "transport-in-use"]
    names = list(dict.fromkeys(names))
    order = [f"{t}:{n}" for t in transports for n in names if n not in last]
    order += [f"{t}:{n}" for t in transports for n in names if n in last]
    out = tmp_path_factory.mktemp(f"{module}{ranks}-{'-'.join(transports)}")
    job = run_suite(module, ranks, out, timeout * len(transports), suite=suite, only=order, transports=transports)
    done = {}
    for t in transports:
        rows = {k.removeprefix(f"{t}:"): row for k, row in job.by_check.items() if k.startswith(f"{t}:")}
        done[t] = SuiteResults(ranks, by_check=rows, log=job.log, transport=t)
    return done


@dataclass(frozen=True)
class Share:
    """A test module's part of a shared job (the module-level ``SHARE``, one Share or a tuple of them, one per rank
    count; :func:`shared_job`, :func:`suites_by_ranks`): its module of checks under tests/distributed/workers, every
    check's name, the seconds its checks may take, the environment they need (given pytest's folder factory), the
    ranks, and ``last``: checks that leave state behind (a failed board or pipeline, receives never completed),
    which the job runs after every other module's checks (True: all of this module's)."""

    checks: str
    names: tuple[str, ...]
    timeout: float
    env: Callable[[pytest.TempPathFactory], dict[str, str]] = lambda _: {}
    last: bool | tuple[str, ...] = False
    ranks: int = 4


#: pytest's timeout for a test of a module in a shared job, beyond the job's own (the sum of its modules' timeouts):
#: its first test waits for the whole job
SHARED_TEST_MARGIN = 300
_SHARED = pytest.StashKey[dict[tuple[str, int], SuiteResults]]()


def shares_of(module: Any) -> tuple[Share, ...]:
    """The Shares a test module declares (its ``SHARE``: one, a tuple, or none)."""
    share = getattr(module, "SHARE", None)
    return (share,) if isinstance(share, Share) else tuple(s for s in share or () if isinstance(s, Share))


def shared_timeout(modules: Any) -> float:
    """pytest's timeout for the tests of ``modules`` that share jobs: the longest shared job's bound plus a margin."""
    jobs: dict[int, float] = {}
    for module in dict.fromkeys(modules):
        for share in shares_of(module):
            jobs[share.ranks] = jobs.get(share.ranks, 0.0) + share.timeout
    return max(jobs.values(), default=0.0) + SHARED_TEST_MARGIN


def shared_job(share: Share) -> Any:
    """A module-scoped fixture ``results``: this module's checks, from the one torchrun job that runs the checks of
    every module of the session that declares a Share on ``share.ranks`` ranks (in file order, the ``last`` checks
    last; only the selected checks of each), run when the first of them asks. Each module sees its own checks by
    their own names; a failure names the check (the test's id) and the job's log says which modules it ran."""

    @pytest.fixture(scope="module")
    def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SuiteResults:
        return shared_results(request.session, tmp_path_factory, share)

    return results


def shared_results(session: pytest.Session, tmp_path_factory: pytest.TempPathFactory, share: Share) -> SuiteResults:
    """``share``'s checks from the shared job of its rank count (run now if it has not run yet in this session)."""
    jobs = session.stash.setdefault(_SHARED, {})
    if (share.checks, share.ranks) not in jobs:
        jobs.update(_run_shared(session, tmp_path_factory, share.ranks))
    return jobs[share.checks, share.ranks]


def _run_shared(
    session: pytest.Session, tmp_path_factory: pytest.TempPathFactory, ranks: int
) -> dict[tuple[str, int], SuiteResults]:
    mine: list[tuple[Share, list[str]]] = []  # every module's Share on these ranks, with its selected checks
    for module in dict.fromkeys(getattr(item, "module", None) for item in session.items):
        for share in shares_of(module):
            chosen = _selected(session, module, ranks)
            if share.ranks == ranks and chosen != []:
                mine.append((share, [n for n in share.names if chosen is None or n in chosen]))
    assert sum(bool(s.last) for s, _ in mine) <= 1, f"one module of the {ranks}-rank shared job may leave state behind"
    several = len(mine) > 1
    first: list[str] = []
    then: list[str] = []
    env: dict[str, str] = {}
    for share, names in mine:
        for name in names:
            late = share.last is True or (isinstance(share.last, tuple) and name in share.last)
            (then if late else first).append(f"{share.checks}:{name}" if several else name)
        for key, value in share.env(tmp_path_factory).items():
            assert env.setdefault(key, value) == value, f"the shared job's modules set {key} differently"
    out = tmp_path_factory.mktemp(f"shared{ranks}")
    modules = ",".join(s.checks for s, _ in mine)
    job = run_suite(modules, ranks, out, sum(s.timeout for s, _ in mine), env=env, only=first + then)
    job.log = f"(one job of {ranks} ranks for {modules})\n{job.log}"
    done = {}
    for share, _ in mine:
        prefix = f"{share.checks}:" if several else ""
        rows = {name.removeprefix(prefix): row for name, row in job.by_check.items() if name.startswith(prefix)}
        done[share.checks, ranks] = SuiteResults(ranks, by_check=rows, log=job.log)
    return done
