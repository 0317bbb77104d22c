"""Executable documentation: every code block of the README and of docs/ runs in the tests, or says why not.

A block is marked by an HTML comment on the line before it (invisible on GitHub and on the built site):

* ``<!-- readme-test: MODE -->`` in README.md, ``<!-- docs-test: MODE -->`` in docs/;
* ``python``: the block runs in a fresh interpreter;
* ``run -n N``: the block runs on N local processes with ``stagewise run``; every rank prints
  ``loss X`` with the same X;
* ``shell``: every line is a ``stagewise ...`` command, run in a scratch folder;
* ``schedules-table``, ``matrix-table``: the text up to ``<!-- end -->`` is the registry's table of schedules,
  or the combination matrix (what each way in supports);
* ``skip REASON``: the block does not run (two machines, minutes of training, a signature); the reason
  is required and shown;
* ``MODE | make docs-test: IDS`` (docs/ only): the block runs in ``make docs-test`` rather than ``make test``, because
  the checks IDS (pytest ids under tests/distributed/, which ``make test`` runs) prove the API it shows against the
  one-process reference; test_docs.py checks that every block runs in one of the two targets and that IDS exist.

A fenced block without a marker fails :func:`unmarked`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
_MARKED = re.compile(
    r"<!-- (?:readme|docs)-test: (?P<mode>[^>]+?) -->\n(?:```\w*\n(?P<code>.*?)```|(?P<table>.*?)<!-- end -->)", re.S
)
_MARKER_LINE = re.compile(r"^<!-- (?:readme|docs)-test: [^>]+ -->$")
MODES = ("python", "run", "shell", "schedules-table", "matrix-table", "skip")
#: after a block's mode: the tests/distributed checks that prove what it shows; the block runs in `make docs-test`
LATER = " | make docs-test: "
RUNS = ("python", "run", "shell")  # the modes that execute


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the marker, 1-based
    mode: str
    code: str

    @property
    def kind(self) -> str:
        return self.mode.split()[0]

    @property
    def spec(self) -> str:
        """The mode without its ``| make docs-test: ...`` part (``run -n 2``)."""
        return self.mode.split(" | ", 1)[0].strip()

    @property
    def proven_by(self) -> list[str]:
        """The checks (pytest ids under tests/distributed/) a block run by `make docs-test` names; [] for the rest."""
        _, later, ids = self.mode.partition(LATER.strip())
        return ids.split() if later else []

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The documentation site's pages (README.md is tested by test_readme.py)."""
    return sorted((ROOT / "docs").rglob("*.md"))


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in _MARKED.finditer(text):
        code = m["code"] if m["code"] is not None else m["table"]
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, m["mode"].strip(), code))
    return out


def unmarked(path: Path) -> list[str]:
    """Fenced code blocks whose line before is not a marker, and markers of an unknown mode or with no reason."""
    problems = []
    lines = path.read_text().splitlines()
    inside = False
    for k, line in enumerate(lines):
        if not line.lstrip().startswith("```"):
            continue
        if not inside and not (k > 0 and _MARKER_LINE.match(lines[k - 1])):
            problems.append(f"{path.relative_to(ROOT)}:{k + 1}: a code block without a test marker")
        inside = not inside
    for block in blocks(path):
        if block.kind not in MODES:
            problems.append(f"{block.id}: unknown mode {block.mode!r}")
        if block.kind == "skip" and len(block.mode.split()) < 3:
            problems.append(f"{block.id}: say why the block cannot run (skip REASON)")
        if "|" in block.mode and not (LATER in f" {block.mode} " and block.proven_by and block.kind in RUNS):
            problems.append(f"{block.id}: write a runnable mode, then '{LATER.strip()} ID ...' (the checks)")
    return problems


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PATH"] = f"{BIN}{os.pathsep}{out.get('PATH', '')}"
    out.setdefault("OMP_NUM_THREADS", "1")
    out["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts prints its Python stacks
    out["PYTHONUNBUFFERED"] = "1"  # each rank's line reaches the pipe whole, as it is printed
    return out


_SHELL = """
import json, sys
from stagewise.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(f"stagewise {' '.join(argv)} exited {code}")
"""


def run_block(block: Block, cwd: Path) -> None:
    """Run one block in ``cwd``; an AssertionError says what failed, with the program's output."""
    if block.kind == "python":
        result = subprocess.run(
            [sys.executable, "-c", block.code], cwd=cwd, env=env(), capture_output=True, text=True, timeout=180
        )
        assert result.returncode == 0, f"{block.id}\n{result.stdout}\n{result.stderr}"
    elif block.kind == "run":
        _run_on_ranks(block, cwd)
    elif block.kind == "shell":
        argvs = []
        for line in block.code.replace("\\\n", " ").splitlines():
            command = line.split("#", 1)[0].strip()
            if not command:
                continue
            assert command.startswith("stagewise "), f"{block.id}: a shell block runs stagewise commands only: {line}"
            argvs.append(shlex.split(command)[1:])
        # the block's commands in one fresh interpreter, in order, each as the console script runs it
        # (`stagewise = "stagewise.cli:main"`; test_cli_installed.py runs the script itself): one start, not one a line
        cmd = [sys.executable, "-c", _SHELL, json.dumps(argvs)]
        result = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=180 * len(argvs))
        assert result.returncode == 0, f"{block.id}:\n{result.stdout}\n{result.stderr}"
    else:
        raise AssertionError(f"{block.id}: mode {block.mode!r} does not run")


def _run_on_ranks(block: Block, cwd: Path) -> None:
    n = int(block.spec.split()[-1])
    script = cwd / "quickstart.py"
    script.write_text(block.code)
    cmd = [str(BIN / "stagewise"), "run", "-n", str(n), str(script)]
    result = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block.id}\n{result.stdout}\n{result.stderr}"
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == n and len(set(losses)) == 1, f"{block.id}: every rank reports the same loss\n{result.stdout}"
    if "for step in range" in block.code:
        assert losses[0] < 1.0, f"{block.id}: the quick start should learn its 64 samples: {result.stdout}"
