"""Cutting a mini-batch into micro-batches, and gluing outputs back together.

A mini-batch is any nesting of tuples, lists and dicts with tensors and other
values at the leaves. Tensors are cut along their batch dim (0 unless told
otherwise) into micro-batches whose sizes differ by at most one, the larger
ones first (``torch.tensor_split``); non-tensor leaves are given to every
micro-batch unchanged.

``dims`` says where the batch dim is: one int (or None) for every tensor, or
a nesting that mirrors the value, e.g. ``(0, 1)`` for ``(tokens, time_major)``
or ``{"ids": 0, "lengths": None}``; None means "not batched: give the whole
tensor to every micro-batch".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

Dims = Any  # int | None | a tuple/list/dict of Dims mirroring the value


class MicroBatches(list):  # type: ignore[type-arg]
    """A mini-batch given already cut, one entry per micro-batch.

    For data that one tensor cannot hold: packed or variable-length sequences,
    where each micro-batch has its own length. Pass it as ``inputs`` (and
    ``targets``) of ``train_step``; each micro-batch's loss is weighted by its
    number of samples. Shapes that differ between micro-batches or steps need
    ``Pipeline(variable_shapes=True)``.
    """


def batch_size(value: Any, dims: Dims = 0, what: str = "inputs") -> int:
    """The number of samples in ``value``; every batched tensor must agree."""
    found: dict[str, int] = {}
    _sizes(value, dims, what, found)
    if not found:
        raise ValueError(f"{what} hold no batched tensor to split into micro-batches")
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{path}: {n}" for path, n in found.items())
        raise ValueError(f"the tensors in {what} disagree on the batch size ({listed})")
    return next(iter(found.values()))


def _sizes(value: Any, dims: Dims, path: str, found: dict[str, int]) -> None:
    for sub_path, leaf, dim in _leaves(value, dims, path):
        if isinstance(leaf, torch.Tensor) and dim is not None:
            if not -leaf.dim() <= dim < leaf.dim():
                raise ValueError(f"{sub_path} has shape {tuple(leaf.shape)}, which has no batch dim {dim}")
            found[sub_path] = leaf.shape[dim]


def split(
    value: Any, num_microbatches: int, dims: Dims = 0, what: str = "inputs", replicas: int = 1
) -> tuple[list[Any], list[int]]:
    """``value`` cut into ``num_microbatches`` pieces, and the number of samples in each. ``replicas``: the
    data-parallel replicas that each hold such a share of a global batch (only for the error's words)."""
    if isinstance(value, MicroBatches):
        if len(value) != num_microbatches:
            raise ValueError(f"the {what} hold {len(value)} micro-batches, but the schedule runs {num_microbatches}")
        return list(value), [batch_size(v, dims, f"{what}[{k}]") for k, v in enumerate(value)]
    total = batch_size(value, dims, what)
    if num_microbatches > total and replicas > 1:  # the user passed the global batch: quote it, and the share
        raise ValueError(
            f"{num_microbatches} micro-batches need at least {num_microbatches} samples per data-parallel replica "
            f"(a global batch of {num_microbatches * replicas} over {replicas} replicas), but this replica's "
            f"{what} hold {total} (a global batch of {total * replicas} over {replicas} replicas)"
        )
    if num_microbatches > total:
        raise ValueError(
            f"{num_microbatches} micro-batches need at least {num_microbatches} samples, "
            f"but the {what} hold a batch of {total}"
        )
    sizes = [len(part) for part in torch.arange(total).tensor_split(num_microbatches)]
    return [_take(value, dims, k, num_microbatches) for k in range(num_microbatches)], sizes


def _take(value: Any, dims: Dims, k: int, n: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value if dims is None else value.tensor_split(n, dim=dims)[k]
    if isinstance(value, (tuple, list)):
        parts = [_take(v, _sub(dims, j), k, n) for j, v in enumerate(value)]
        if isinstance(value, list):
            return parts
        return type(value)(*parts) if hasattr(value, "_fields") else tuple(parts)
    if isinstance(value, dict):
        return {key: _take(v, _sub(dims, key), k, n) for key, v in value.items()}
    return value


def _sub(dims: Dims, key: Any) -> Dims:
    if dims is None or isinstance(dims, int):
        return dims
    try:
        return dims[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"batch dims {dims!r} have no entry for {key!r}; give one per input") from None


def _leaves(value: Any, dims: Dims, path: str):  # type: ignore[no-untyped-def]
    if isinstance(value, (tuple, list)):
        for j, v in enumerate(value):
            yield from _leaves(v, _sub(dims, j), f"{path}[{j}]")
    elif isinstance(value, dict):
        for key, v in value.items():
            yield from _leaves(v, _sub(dims, key), f"{path}[{key!r}]")
    else:
        if not (dims is None or isinstance(dims, int)):
            kind = type(value).__name__
            raise ValueError(f"batch dims {dims!r} at {path} describe a container, but {path} is a {kind}")
        yield path, value, dims


def merge(pieces: list[Any], dim: int = 0) -> Any:
    """Concatenate per-micro-batch outputs along ``dim``; non-tensor leaves come from the first piece."""
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(pieces, dim=dim) if first.dim() > 0 else torch.stack(pieces)
    if isinstance(first, (tuple, list)):
        parts = [merge([p[j] for p in pieces], dim) for j in range(len(first))]
        if isinstance(first, list):
            return parts
        return type(first)(*parts) if hasattr(first, "_fields") else tuple(parts)
    if isinstance(first, dict):
        return {key: merge([p[key] for p in pieces], dim) for key in first}
    return first


def input_ids_of(value: Any) -> Any:
    """A language model's token ids in a (micro-)batch of inputs: the value itself, the first of a tuple or list
    (``(input_ids, attention_mask)``), or a tokenizer's dict's ``input_ids`` (None if it has none)."""
    if isinstance(value, Mapping):  # (a tokenizer's BatchEncoding is a UserDict, not a dict)
        return value.get("input_ids")
    return value[0] if isinstance(value, (tuple, list)) and value else value
