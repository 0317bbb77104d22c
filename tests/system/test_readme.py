"""Everything the README shows is executed here, so it cannot rot.

Blocks are marked with an HTML comment on the line before them:
``<!-- readme-test: python -->`` runs the Python block in a fresh interpreter,
``<!-- readme-test: run -n N -->`` runs it on N processes with ``stagewise run``,
``<!-- readme-test: shell -->`` runs each ``stagewise ...`` line, and
``<!-- readme-test: schedules-table -->`` must equal the table generated from the registry.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stagewise.schedules import markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = Path(sys.executable).parent
_BLOCK = re.compile(
    r"<!-- readme-test: (?P<mode>[^>]+?) -->\n(?:```\w*\n(?P<code>.*?)```|(?P<table>.*?)<!-- end -->)", re.S
)


def _blocks() -> list[tuple[str, str]]:
    return [
        (m["mode"], m["code"] if m["code"] is not None else m["table"]) for m in _BLOCK.finditer(README.read_text())
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts prints its Python stacks
    env["PYTHONUNBUFFERED"] = "1"  # each rank's line reaches the pipe whole, as it is printed
    return env


def test_the_readme_has_executable_blocks() -> None:
    modes = [mode.split()[0] for mode, _ in _blocks()]
    assert {"python", "run", "shell", "schedules-table"} <= set(modes)


def test_schedule_table_is_the_registry() -> None:
    tables = [text.strip() for mode, text in _blocks() if mode == "schedules-table"]
    assert tables == [markdown_table()], (
        "regenerate the README table with stagewise.schedules.registry.markdown_table()"
    )


@pytest.mark.parametrize("index", [i for i, (mode, _) in enumerate(_blocks()) if mode != "schedules-table"])
def test_block_runs(index: int, tmp_path: Path) -> None:
    mode, code = _blocks()[index]
    if mode == "python":
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
    elif mode.startswith("run"):
        n = int(mode.split()[-1])
        script = tmp_path / "quickstart.py"
        script.write_text(code)
        cmd = [str(BIN / "stagewise"), "run", "-n", str(n), str(script)]
        result = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout + result.stderr
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
        assert len(losses) == n and len(set(losses)) == 1, result.stdout  # every rank reports the same loss
        if "for step in range" in code:
            assert losses[0] < 1.0, f"the quick start should learn its 64 samples: {result.stdout}"
    elif mode == "shell":
        for line in code.replace("\\\n", " ").splitlines():
            if not line.startswith("stagewise "):
                continue
            argv = shlex.split(line.split("#", 1)[0])
            result = subprocess.run(
                [str(BIN / argv[0]), *argv[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
            )
            assert result.returncode == 0, f"{line}\n{result.stderr}"
    else:
        raise AssertionError(f"unknown README test mode {mode!r}")
