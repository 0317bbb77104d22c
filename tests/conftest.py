"""The whole suite: processes the tests start import the test helpers the way pytest does.

pytest puts the folders of the ``pythonpath`` option (pyproject.toml) on its own ``sys.path``; the ranks that
torchrun or ``stagewise run`` start, and any fresh interpreter a test runs, get the same folders in PYTHONPATH.
Each kind of test sets its marker in its own folder's conftest.py.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    before = os.environ.get("PYTHONPATH")
    paths = [str(p) for p in config.getini("pythonpath")] + ([before] if before else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    config.add_cleanup(lambda: _restore(before))


def _restore(before: str | None) -> None:
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before
