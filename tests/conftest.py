"""The whole suite: processes the tests start import the test helpers the way pytest does.

pytest puts the folders of the ``pythonpath`` option (pyproject.toml) on its own ``sys.path``; the ranks that
torchrun or ``stagewise run`` start, and any fresh interpreter a test runs, get the same folders in PYTHONPATH.
Each kind of test sets its marker in its own folder's conftest.py.

The processes the tests start get a temporary folder of the session's own (TMPDIR), removed at its end: torchrun
leaves a ``torchelastic_*`` log folder per job and an elastic ``stagewise run`` its traceback folders
(``stagewise-<id>-<time>-<pid>``), hundreds of them in /tmp after a few runs of the suite.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    before = os.environ.get("PYTHONPATH")
    paths = [str(p) for p in config.getini("pythonpath")] + ([before] if before else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    config.add_cleanup(lambda: _restore("PYTHONPATH", before))
    tempfile.gettempdir()  # this process keeps its own (pytest's tmp_path lives there), cached before the change
    children = tempfile.mkdtemp(prefix="stagewise-tests-")
    config.add_cleanup(lambda: shutil.rmtree(children, ignore_errors=True))
    tmpdir = os.environ.get("TMPDIR")
    config.add_cleanup(lambda: _restore("TMPDIR", tmpdir))
    os.environ["TMPDIR"] = children


def _restore(name: str, before: str | None) -> None:
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


# ``stagewise run`` with torchrun replaced by a recorder of its arguments and environment (tests/core and
# tests/runtime launch checks)
@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, list[tuple[list[str], dict[str, str]]]]:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    calls: list[tuple[list[str], dict[str, str]]] = []
    import stagewise.runtime.launch as launch

    def torchrun(
        argv: list[str], env: dict[str, str] | None = None, explain: object = None, watch: object = None
    ) -> int:
        calls.append((argv, env or {}))
        return 0

    monkeypatch.setattr(launch, "torchrun", torchrun)
    return script, calls
