"""``LiveBytes``: the peak of live tensor bytes over a block, above what was held at its start (exact, not RSS)."""

from __future__ import annotations

import torch

from stagewise.runtime.measure.tensor_bytes import LiveBytes, state_tensors, storage_bytes


def test_the_peak_counts_what_is_alive_at_once_and_views_once() -> None:
    with LiveBytes() as live:
        a = torch.empty(1000, dtype=torch.float64)  # 8000 bytes
        view = a[10:20]  # the same storage: not counted again
        del a
        b = torch.ones(250, dtype=torch.float32)  # 1000 bytes, while a's storage lives on through the view
        del view
        c = torch.zeros(100, dtype=torch.float64)  # 800 bytes: a's storage is gone
    assert live.extra == 9000, live.extra
    assert live.at_peak == [(8000, "aten.empty.memory_format"), (1000, "aten.ones.default")], live.at_peak
    assert live.now() == 1800 and (b.numel(), c.numel()) == (250, 100)


def test_releasing_what_was_held_lowers_the_total() -> None:
    held = [torch.empty(1000, dtype=torch.float64)]
    with LiveBytes().hold(held) as live:
        assert live.start == 8000
        held.clear()  # released inside the block: a new buffer of the same size adds nothing above the start
        fresh = torch.empty(1000, dtype=torch.float64)
        fresh.add_(1)
    assert live.extra == 0, live.extra
    later = torch.empty(10)
    assert live.now() == 8000 and later.numel() == 10  # (the mode is off: a tensor made after is not tracked)


def test_a_pipeline_s_state_counts_tied_storage_once() -> None:
    net = torch.nn.Linear(4, 4, dtype=torch.float64)
    opt = torch.optim.Adam(net.parameters())
    net(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    net.optimizers = {0: opt}
    tensors = state_tensors(net)
    per = (16 + 4) * 8
    assert storage_bytes(tensors) == 4 * per + 2 * 4  # parameters, gradients, two moments; Adam's steps (float32)
    assert storage_bytes([*tensors, net.weight]) == storage_bytes(tensors)
