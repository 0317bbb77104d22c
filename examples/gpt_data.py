"""A corpus that needs no download: a fixed subset of the Python standard library's own source.

The files are found from the running interpreter (``sysconfig``), read as
bytes and concatenated in the order of :data:`STDLIB_FILES`, so a given Python
version always yields the same corpus (about 0.69 MB on CPython 3.11). Tokens
are bytes (vocabulary 256): no tokenizer to train or ship. The last 5 % of the
bytes (the end of ``ipaddress.py``) are held out for validation.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

#: ~0.7 MB of Python source, present in every CPython >= 3.9 installation
STDLIB_FILES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "functools.py",
    "dataclasses.py",
    "fractions.py",
    "statistics.py",
    "shlex.py",
    "difflib.py",
    "pprint.py",
    "argparse.py",
    "csv.py",
    "enum.py",
    "json/encoder.py",
    "json/decoder.py",
    "graphlib.py",
    "calendar.py",
    "colorsys.py",
    "ipaddress.py",
)
VOCAB_SIZE = 256

Batch = tuple[torch.Tensor, torch.Tensor]


def stdlib_corpus(files: tuple[str, ...] = STDLIB_FILES) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of bytes; missing files are skipped rather than fatal."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, missing = [], []
    for name in files:
        path = root / name
        if path.is_file():
            chunks.append(path.read_bytes())
        else:
            missing.append(name)
    if not chunks:
        raise FileNotFoundError(f"none of the corpus files were found under {root}: {missing}")
    data = b"\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def split(data: torch.Tensor, valid_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid): the first ``1 - valid_fraction`` of the bytes, and the rest."""
    cut = int(len(data) * (1 - valid_fraction))
    return data[:cut], data[cut:]


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[Batch]:
    """Endless random windows: (inputs, targets) of shape (batch, seq_len), targets shifted by one byte.

    The same seed gives the same batches in every process, so each rank can
    draw them itself and use its part (stage 0 the inputs, the last stage the targets).
    """
    if len(data) <= seq_len + 1:
        raise ValueError(f"the data has {len(data)} bytes, too few for windows of {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        yield window[:, :-1], window[:, 1:]


def eval_batches(data: torch.Tensor, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
    """Fixed validation batches: consecutive non-overlapping windows from the start of ``data``."""
    n = min(max_batches, (len(data) - 1) // (seq_len * batch_size))
    if n < 1:
        raise ValueError(f"the validation data ({len(data)} bytes) is smaller than one batch of {batch_size}x{seq_len}")
    out = []
    for b in range(n):
        starts = [(b * batch_size + i) * seq_len for i in range(batch_size)]
        window = torch.stack([data[s : s + seq_len + 1] for s in starts]).long()
        out.append((window[:, :-1], window[:, 1:]))
    return out
