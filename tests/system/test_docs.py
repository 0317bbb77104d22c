"""The documentation site's pages (docs/**/*.md) are executed as the README is: every code block runs here or
says why it cannot (tests/helpers/doc_blocks.py). Also: the layout page matches the tree, every public name
is in the API reference, and every example documents its options. The site's build and rendering:
test_docs_site.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import stagewise as sw
from helpers.doc_blocks import ROOT, Block, blocks, pages, run_block, unmarked
from stagewise.schedules import markdown_table

DOCS = ROOT / "docs"


def test_every_code_block_is_marked() -> None:
    assert [problem for page in pages() for problem in unmarked(page)] == []


def test_schedule_tables_are_the_registry() -> None:
    tables = [b.code.strip() for page in pages() for b in blocks(page) if b.kind == "schedules-table"]
    assert tables and all(table == markdown_table() for table in tables)


@pytest.mark.parametrize(
    "block", [b for page in pages() for b in blocks(page) if b.kind in ("python", "run", "shell")], ids=lambda b: b.id
)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


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
