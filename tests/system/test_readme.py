"""Everything the README shows is executed here, so it cannot rot (the markers: tests/helpers/doc_blocks.py).

``<!-- readme-test: python -->`` runs the Python block in a fresh interpreter, ``<!-- readme-test: run -n N -->``
on N processes with ``stagewise run``, ``<!-- readme-test: shell -->`` each ``stagewise ...`` line,
``<!-- readme-test: schedules-table -->`` must equal the table generated from the registry,
``<!-- readme-test: matrix-table -->`` the combination matrix (tests/distributed/workers/matrix_spec.py), and
``<!-- readme-test: skip REASON -->`` says why a block cannot run. The docs site's pages: test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.doc_blocks import ROOT, Block, blocks, run_block, unmarked
from matrix_spec import markdown as matrix_table
from stagewise.schedules import markdown_table

README = ROOT / "README.md"
MAX_LINES = 300  # read in ten minutes; the rest lives in docs/


def test_the_readme_has_executable_blocks() -> None:
    kinds = [block.kind for block in blocks(README)]
    assert {"run", "shell", "schedules-table", "matrix-table"} <= set(kinds)
    assert unmarked(README) == []
    assert [b.id for b in blocks(README) if b.proven_by] == [], "every README block runs in `make test`"


def test_the_ways_in_table_is_the_combination_matrix() -> None:
    """What each way in supports: the matrix tests/distributed/test_matrix.py runs, as docs/matrix.md shows it."""
    tables = [block.code.strip() for block in blocks(README) if block.kind == "matrix-table"]
    assert tables == [matrix_table().strip()], "copy tests/distributed/workers/matrix_spec.markdown() into README.md"


def test_the_readme_is_short_and_links_into_the_docs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"


def test_schedule_table_is_the_registry() -> None:
    tables = [block.code.strip() for block in blocks(README) if block.kind == "schedules-table"]
    assert tables == [markdown_table()], (
        "regenerate the README table with stagewise.schedules.registry.markdown_table()"
    )


@pytest.mark.parametrize(
    "block", [b for b in blocks(README) if b.kind in ("python", "run", "shell")], ids=lambda b: b.id
)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
