"""tests/runtime: torch in this one process (a one-rank process group at most, no launcher); marked ``runtime``."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.runtime)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads would only contend for the (shared, small) CPU."""
    import torch  # here, not at the top: loading this conftest must not load torch before tests/core is judged

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_posted_failure_left() -> Iterator[None]:
    """A failure a test posted (``heartbeat.post_failure``, or read on a store) is process-wide: left set, the next
    test's exchanges would give up at once, racing their own threads (a flaky test, 2026-12-04). A test that
    posted one has ended its run: the heartbeat is stopped after it, which clears the flag."""
    yield
    heartbeat = sys.modules.get("stagewise.runtime.comm.faults.heartbeat")
    if heartbeat is not None and heartbeat._posted.is_set():
        heartbeat.stop()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[object]:
    """A one-process gloo group (no torchrun variables) for the module's tests; its ``sw.init`` environment."""
    import torch.distributed as dist

    import stagewise as sw

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with warnings.catch_warnings():  # one process on purpose: no "no launcher" notice
        warnings.filterwarnings("ignore", message="stagewise.init: no launcher")
        env = sw.init(backend="gloo")
    assert (env.rank, env.world_size, env.device.type) == (0, 1, "cpu")
    yield env
    dist.destroy_process_group()
