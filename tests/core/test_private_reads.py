"""No private attribute read across rooms (issue 46): a room reads another room's objects through what they
declare (:class:`stagewise.runtime.checkpoint.declared.PipelineState`, public methods and properties), never
through a name with a leading underscore that the other room defines. Read as text: nothing here imports torch.

A *room* is a package under ``stagewise`` (``planning``, ``ir``...), and under ``runtime`` one of the runtime's
rooms (``runtime/relayout``, ``runtime/pipeline.py``...: ``tests/core/test_layering.py``'s floors). A private
*read* is ``x._name`` with ``x`` not ``self`` / ``cls``, or ``getattr`` / ``hasattr`` / ``setattr(x, "_name")``;
it crosses rooms when stagewise defines ``_name`` (a method, a class field, or a ``self._name =``) in another room
and not in the reader's own. A private name of torch's (``module._modules``) is not stagewise's to declare: it is
outside this check.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"

#: (file, name): a read that stays, and why
ALLOWED = {
    # torch.Tensor._base (a view's base tensor), not simulation.arrays' field of the same name
    ("runtime/features/memory.py", "_base"),
}


def _room(src: Path, path: Path) -> str:
    parts = path.relative_to(src).parts
    if parts[0] == "runtime" and len(parts) > 1:
        return f"runtime/{parts[1]}"
    return parts[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """The private names a file defines: methods and fields of its classes, attributes set on ``self`` / ``cls``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    out.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _on_self(node.value):
            out.add(node.attr)
    return {name for name in out if _private(name)}


def _on_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, name, the expression) for each private read of another object in a file."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _on_self(node.value):
            out.append((node.lineno, node.attr, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not _on_self(node.args[0])
        ):
            out.append((node.lineno, node.args[1].value, ast.unparse(node)))
    return out


def cross_room_reads(src: Path) -> list[tuple[str, str, str]]:
    """(``file:line``, name, what reads it) for every private read across rooms under ``src``."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(src.rglob("*.py"))}
    where: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for name in _defined(tree):
            where.setdefault(name, set()).add(_room(src, path))
    found = []
    for path, tree in trees.items():
        room = _room(src, path)
        for line, name, text in _reads(tree):
            if where.get(name) and room not in where[name]:
                rel = path.relative_to(src).as_posix()
                found.append((f"{rel}:{line}", name, f"{text} (defined in {', '.join(sorted(where[name]))})"))
    return found


def test_no_room_reads_another_rooms_private_attributes() -> None:
    found = cross_room_reads(SRC)
    new = [f"{at}: {text}" for at, name, text in found if (at.split(":")[0], name) not in ALLOWED]
    assert new == [], "read through a public method or property of the owner (or declare it):\n" + "\n".join(new)
    stale = ALLOWED - {(at.split(":")[0], name) for at, name, _ in found}
    assert not stale, f"allowed reads that no longer happen (remove them from ALLOWED): {sorted(stale)}"


def test_the_check_finds_a_read_across_rooms_and_not_one_within(tmp_path: Path) -> None:
    """What the check must see: ``job._store`` and ``getattr(pipe, "_engine")`` from another room; a room's own
    private names and ``self._x`` are its own business."""
    (tmp_path / "runtime" / "relayout").mkdir(parents=True)
    (tmp_path / "runtime" / "elastic").mkdir()
    (tmp_path / "runtime" / "relayout" / "generation.py").write_text(
        "class InPlace:\n    _store = None\n\n    def _drop(self):\n        self._engine = 1\n"
    )
    (tmp_path / "runtime" / "relayout" / "kept.py").write_text("def f(job):\n    return job._drop()\n")
    (tmp_path / "runtime" / "elastic" / "joining.py").write_text(
        "def g(job, pipe):\n    job._store.set('x')\n    return getattr(pipe, '_engine', None), job.store\n"
    )
    found = sorted((at, name) for at, name, _ in cross_room_reads(tmp_path))
    assert found == [("runtime/elastic/joining.py:2", "_store"), ("runtime/elastic/joining.py:3", "_engine")]
