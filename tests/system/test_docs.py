"""The documentation site's pages (docs/**/*.md) are executed as the README is: every code block runs or says why
it cannot (tests/helpers/doc_blocks.py). A block marked ``| make docs-test: IDS`` runs in ``make docs-test``
(STAGEWISE_DOCS_TEST=1), not in ``make test``: the tests/distributed checks IDS, which ``make test`` runs, prove the
API it shows against the one-process reference (a `stagewise run` of 2-4 processes costs 10-60 s of CPU; the
README's blocks all run here; a page's block that is a README block letter for letter runs there alone). Also:
the layout page matches the tree, every public name is in the API reference, and every example documents its
options. The site's build and rendering: test_docs_site.py."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stagewise as sw
from helpers.doc_blocks import ROOT, RUNS, Block, blocks, pages, run_block, unmarked
from stagewise.schedules import markdown_table

DOCS = ROOT / "docs"
DISTRIBUTED = ROOT / "tests" / "distributed"
#: `make docs-test`: run the blocks `make test` leaves to it (those marked ``| make docs-test: IDS``)
DOCS_TEST = os.environ.get("STAGEWISE_DOCS_TEST") == "1"
RUNNABLE = [b for page in pages() for b in blocks(page) if b.kind in RUNS]
#: a page's block that is a README block, letter for letter and run alike, runs once: in test_readme.py
README_RUNS = {(b.spec, b.code) for b in blocks(ROOT / "README.md") if b.kind in RUNS}


def test_every_code_block_is_marked() -> None:
    assert [problem for page in pages() for problem in unmarked(page)] == []


def test_schedule_tables_are_the_registry() -> None:
    tables = [b.code.strip() for page in pages() for b in blocks(page) if b.kind == "schedules-table"]
    assert tables and all(table == markdown_table() for table in tables)


def _in_readme(block: Block) -> bool:
    return (block.spec, block.code) in README_RUNS


def test_the_quick_start_is_the_readme_s() -> None:
    """The site's front page shows the README's quick start: the same text, so one run proves both."""
    assert [b.id for b in RUNNABLE if _in_readme(b)] == ["docs/index.md:40"]


@pytest.mark.parametrize(
    "block", [b for b in RUNNABLE if bool(b.proven_by) == DOCS_TEST and not _in_readme(b)], ids=lambda b: b.id
)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.proven_by:  # `make docs-test`: the checks it names are still there
        collected = set().union(*(_collected(file) for file in {i.split("::")[0] for i in block.proven_by}))
        missing = sorted(set(block.proven_by) - collected)
        assert not missing, f"{block.id}: no such test in tests/distributed: {missing}"
    run_block(block, tmp_path)


@functools.cache
def _collected(file: str) -> set[str]:
    """The pytest ids of ``file`` (under tests/distributed/, as markers name them), as `make test` collects them
    (one file at a time: collecting imports torch and the checks, minutes on a loaded machine)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", str(DISTRIBUTED / file)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prefix = "tests/distributed/"
    return {line.strip().removeprefix(prefix) for line in done.stdout.splitlines() if line.startswith(prefix)}


def test_every_block_runs_in_make_test_or_make_docs_test() -> None:
    """None goes unrun: a block is in `make test`, or names the checks that prove it and runs in `make docs-test`
    (a Makefile target of this file under STAGEWISE_DOCS_TEST=1). The ids are checked for their file and test here
    (cheap); `make docs-test` checks each id is collected."""
    later = [b for b in RUNNABLE if b.proven_by]
    assert later and len(later) < len(RUNNABLE)
    for block in later:
        for check in block.proven_by:
            file, _, test = check.partition("::")
            assert (DISTRIBUTED / file).is_file() and test, f"{block.id}: {check} is not a test of tests/distributed"
            name = test.split("[")[0]
            assert f"def {name}(" in (DISTRIBUTED / file).read_text(), f"{block.id}: no {name} in {file}"
    target = re.search(r"^docs-test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert target and "STAGEWISE_DOCS_TEST=1" in target[1] and "tests/system/test_docs.py" in target[1], target
    assert "make docs-test" in (ROOT / "CONTRIBUTING.md").read_text()


def _layout_tree() -> str:
    text = (DOCS / "layout.md").read_text()
    found = re.search(r"<!-- docs-test: skip the tree.*?-->\n```\w*\n(.*?)```", text, re.S)
    assert found, "docs/layout.md holds the tree in a block marked 'skip the tree ...'"
    return found.group(1)


def test_the_layout_page_matches_the_tree() -> None:
    """Every folder the tree names exists, and every package of src/stagewise and its runtime is named."""
    tree = _layout_tree()
    named = set(re.findall(r"([\w.]+)/", tree))
    for folder in ["src/stagewise", "src/stagewise/runtime"]:
        for child in sorted((ROOT / folder).iterdir()):
            if child.is_dir() and (child / "__init__.py").exists():
                assert child.name in named, f"docs/layout.md does not name {folder}/{child.name}/"
    every_folder = {p.name for top in ("src", "tests", "benchmarks") for p in (ROOT / top).rglob("*") if p.is_dir()}
    every_folder |= {p.name for p in ROOT.iterdir() if p.is_dir()}
    assert named <= every_folder, f"docs/layout.md names folders that do not exist: {sorted(named - every_folder)}"


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    missing = [name for name in sw.__all__ if not re.search(rf"\b{name}\b", reference)]
    assert missing == []


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_every_example_option_has_help(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            assert any(k.arg == "help" for k in node.keywords), f"{path.name}:{node.lineno}: an option without help"
