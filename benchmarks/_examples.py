"""The examples' models and data, for the benchmarks that train them.

    GPTConfig = example("gpt_model").GPTConfig

The examples are scripts (``stagewise run -n 4 examples/gpt_stdlib.py``) that
import one another by bare name (``from gpt_model import GPTConfig``), which
works because a script's folder comes first on its module path. The benchmarks
are a package and leave the module path alone: :func:`example` loads an
example's file under that same bare name, after the siblings it imports
(:data:`NEEDS`), so its own imports find them already loaded.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: the siblings an example imports by bare name, loaded before it
NEEDS: dict[str, tuple[str, ...]] = {
    "digits_cnn": ("reporting",),
    "hybrid_tp_pp": ("gpt_model",),
    "resnet_digits": ("reporting", "digits_cnn"),
}


def example(name: str) -> ModuleType:
    """``examples/NAME.py`` as the module ``NAME`` (loaded once; its siblings first)."""
    path = EXAMPLES / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise ImportError(f"examples/{name}.py: another module {name!r} is loaded already ({loaded!r})")
        return loaded
    for sibling in NEEDS.get(name, ()):
        example(sibling)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no example {name!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
