"""Nested values (tensors inside tuples, lists and dicts) as a flat tensor list plus a picklable spec.

Values that cross a stage boundary travel as their tensor leaves; the spec
carries the containers and every non-tensor leaf, so the receiver rebuilds the
same value. Tuples, lists and dicts are containers; anything else that is not
a tensor is a constant leaf (a string, a number, ``None``).
"""

from __future__ import annotations

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
    tag = spec[0]
    if tag == "T":
        out.append(prefix)
    elif tag in ("tuple", "list"):
        for k, s in enumerate(spec[1]):
            _paths(s, f"{prefix}[{k}]", out)
    elif tag == "namedtuple":
        for name, s in zip(spec[1]._fields, spec[2]):
            _paths(s, f"{prefix}.{name}", out)
    elif tag == "dict":
        for k, s in zip(spec[1], spec[2]):
            _paths(s, f"{prefix}[{k!r}]", out)


def same_spec(a: Spec, b: Spec) -> bool:
    """Spec equality that tolerates constants whose ``==`` is not a plain bool."""
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays as constants
        return False
