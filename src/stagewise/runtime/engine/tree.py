"""Nested values (tensors inside tuples, lists and dicts) as a flat tensor list plus a plain-data spec.

Values that cross a stage boundary travel as their tensor leaves; the spec
carries the containers and every non-tensor leaf, so the receiver rebuilds the
same value. Tuples, lists and dicts are containers; anything else that is not
a tensor is a constant leaf (a string, a number, ``None``).

A spec crosses ranks as JSON (:func:`spec_to_plain`, :func:`spec_from_plain`):
constants and dict keys must be strings, numbers, booleans or None, and a
namedtuple travels by its qualified name, found again among the receiver's
loaded modules (nothing is imported or unpickled on a peer's word).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

#: ("T",) a tensor leaf; ("C", value) a constant; ("tuple"|"list", children);
#: ("namedtuple", type, children); ("dict", keys, children)
Spec = tuple[Any, ...]

TENSOR: Spec = ("T",)


def flatten(value: Any) -> tuple[list[torch.Tensor], Spec]:
    """The tensor leaves of ``value`` in a fixed order (dicts in insertion order), and its spec."""
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(value, leaves)


def _flatten(value: Any, leaves: list[torch.Tensor]) -> Spec:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return TENSOR
    if isinstance(value, tuple):
        children = tuple(_flatten(v, leaves) for v in value)
        return ("namedtuple", type(value), children) if hasattr(value, "_fields") else ("tuple", children)
    if isinstance(value, list):
        return ("list", tuple(_flatten(v, leaves) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(value.keys()), tuple(_flatten(v, leaves) for v in value.values()))
    return ("C", value)


def unflatten(spec: Spec, leaves: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`: ``unflatten(*reversed(flatten(v)))`` equals ``v``."""
    it = iter(leaves)
    value = _unflatten(spec, it)
    if next(it, None) is not None:
        raise ValueError("unflatten: more tensors than the spec has leaves")
    return value


def _unflatten(spec: Spec, it: Any) -> Any:
    tag = spec[0]
    if tag == "T":
        try:
            return next(it)
        except StopIteration:
            raise ValueError("unflatten: fewer tensors than the spec has leaves") from None
    if tag == "C":
        return spec[1]
    if tag == "tuple":
        return tuple(_unflatten(s, it) for s in spec[1])
    if tag == "list":
        return [_unflatten(s, it) for s in spec[1]]
    if tag == "namedtuple":
        return spec[1](*(_unflatten(s, it) for s in spec[2]))
    if tag == "dict":
        return {k: _unflatten(s, it) for k, s in zip(spec[1], spec[2])}
    raise ValueError(f"unflatten: unknown spec node {tag!r}")


def leaf_paths(spec: Spec, root: str = "output") -> list[str]:
    """A readable name per tensor leaf, e.g. ``output[1]['mask']``, for error messages."""
    paths: list[str] = []
    _paths(spec, root, paths)
    return paths


def _paths(spec: Spec, prefix: str, out: list[str]) -> None:
    if spec[0] == "T":
        out.append(prefix)
    for name, child in _children(spec, prefix):
        _paths(child, name, out)


def _children(spec: Spec, prefix: str) -> list[tuple[str, Spec]]:
    """A container's parts, each with its readable name (``prefix[1]``, ``prefix.field``, ``prefix['key']``)."""
    tag = spec[0]
    if tag in ("tuple", "list"):
        return [(f"{prefix}[{k}]", s) for k, s in enumerate(spec[1])]
    if tag == "namedtuple":
        return [(f"{prefix}.{name}", s) for name, s in zip(spec[1]._fields, spec[2])]
    if tag == "dict":
        return [(f"{prefix}[{k!r}]", s) for k, s in zip(spec[1], spec[2])]
    return []


def spec_difference(new: Spec, old: Spec, root: str = "output") -> str:
    """Where ``new`` first differs from ``old``, in words (``output[2] is a tensor, where it was None``), for
    error messages; "" when they are the same."""
    found = _differs(new, old, root)
    if found is None:
        return ""
    path, a, b = found
    return f"{path} is {_what(a)}, where it was {_what(b)}"


def _what(spec: Spec) -> str:
    tag = spec[0]
    if tag == "T":
        return "a tensor"
    if tag == "C":
        text = repr(spec[1])
        return text if len(text) <= 40 else text[:37] + "..."
    if tag in ("tuple", "list"):
        return f"a {tag} of {len(spec[1])}"
    if tag == "namedtuple":
        return f"a {spec[1].__name__}"
    return f"a dict of keys {list(spec[1])}"


def _differs(new: Spec, old: Spec, prefix: str) -> tuple[str, Spec, Spec] | None:
    if same_spec(new, old):
        return None
    tag = new[0]
    if tag != old[0] or tag in ("T", "C") or not same_spec(new[1:-1], old[1:-1]) or len(new[-1]) != len(old[-1]):
        return prefix, new, old  # (the kind, a namedtuple's type, a dict's keys or the length differ)
    for (name, a), (_, b) in zip(_children(new, prefix), _children(old, prefix)):
        found = _differs(a, b, name)
        if found is not None:
            return found
    return prefix, new, old


def same_spec(a: Spec, b: Spec) -> bool:
    """Spec equality that tolerates constants whose ``==`` is not a plain bool."""
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays as constants
        return False


_PLAIN = (str, int, float, bool, type(None))


def spec_to_plain(spec: Spec, where: str = "value") -> Any:
    """``spec`` as JSON-able data; a constant (or dict key) that JSON cannot carry is an error naming it."""
    tag = spec[0]
    if tag == "T":
        return ["T"]
    if tag == "C":
        if not isinstance(spec[1], _PLAIN):
            raise TypeError(
                f"{where} holds a constant of type {type(spec[1]).__name__}: values crossing stages may hold only "
                "tensors, tuples, lists, dicts and str / int / float / bool / None constants"
            )
        return ["C", spec[1]]
    if tag in ("tuple", "list"):
        return [tag, [spec_to_plain(c, f"{where}[{k}]") for k, c in enumerate(spec[1])]]
    if tag == "namedtuple":
        kind = spec[1]
        children = [spec_to_plain(c, f"{where}.{n}") for n, c in zip(kind._fields, spec[2])]
        return ["namedtuple", f"{kind.__module__}:{kind.__qualname__}", children]
    if tag == "dict":
        for key in spec[1]:
            if not isinstance(key, _PLAIN):
                kind = type(key).__name__
                raise TypeError(f"{where} is a dict with a key of type {kind}: keys must be str or numbers")
        return ["dict", list(spec[1]), [spec_to_plain(c, f"{where}[{k!r}]") for k, c in zip(spec[1], spec[2])]]
    raise ValueError(f"unknown spec node {tag!r}")


def spec_from_plain(data: Any) -> Spec:
    """Inverse of :func:`spec_to_plain` (tuples again, namedtuple types looked up among loaded modules)."""
    tag = data[0]
    if tag == "T":
        return TENSOR
    if tag == "C":
        return ("C", data[1])
    if tag in ("tuple", "list"):
        return (tag, tuple(spec_from_plain(c) for c in data[1]))
    if tag == "namedtuple":
        return ("namedtuple", _namedtuple_type(data[1]), tuple(spec_from_plain(c) for c in data[2]))
    if tag == "dict":
        return ("dict", tuple(data[1]), tuple(spec_from_plain(c) for c in data[2]))
    raise ValueError(f"unknown spec node {tag!r} from a peer")


def _namedtuple_type(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, tuple) and hasattr(found, "_fields")):
        raise TypeError(
            f"a peer sent a namedtuple {name!r} that is not a namedtuple among this rank's loaded modules "
            "(define it at module level, in a module every rank imports)"
        )
    return found
