"""Forgetting the launcher: ``python quickstart.py`` (no torchrun variables) runs as one process, and
``sw.init`` says so once, with how to start several. A module of its own: it needs no process group alive (a
module-scoped one-rank group elsewhere would still be)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch.distributed as dist

import stagewise as sw
from stagewise.runtime.comm import setup


def test_init_without_a_launcher_says_so_once_and_how_to_start_several(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(setup, "_warned", False)
    monkeypatch.setattr(sys, "argv", ["quickstart.py"])
    try:
        with pytest.warns(UserWarning, match=r"runs as one process.*stagewise run -n 4 quickstart.py"):
            sw.init("gloo")
        dist.destroy_process_group()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sw.init("gloo")  # once per process
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
