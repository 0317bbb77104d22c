"""BatchNorm under micro-batching (issue 18) in one process: the statistics, the option, a one-rank pipeline.

The multi-rank checks are in tests/distributed/test_batchnorm_ranks.py.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchnorm_checks as bc
import stagewise as sw
from stagewise.runtime.features import batchnorm as bnm
from stagewise.runtime.features.batchnorm import BatchNormPolicy, check_batchnorm
from stagewise.runtime.features.batchnorm_moments import Moments, combine, commit

SIZES = [(5,), (4, 4, 3, 3), (1, 7, 2), (2, 2, 2, 2, 2, 2)]


def _batch(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64) * 3.0 + 100.0  # a large mean: cancellation


# ---- the statistics -------------------------------------------------------------------
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("shape", [(6,), (3, 5), (2, 3, 3)], ids=["1d", "1d-seq", "2d"])
def test_combined_moments_are_those_of_the_concatenation(sizes: tuple[int, ...], shape: tuple[int, ...]) -> None:
    x = _batch(sum(sizes), shape, seed=len(sizes))
    whole = combine([Moments.of(part) for part in x.split(list(sizes))])
    dims = [0, *range(2, x.dim())]
    assert whole.n == x.numel() // x.shape[1]
    torch.testing.assert_close(whole.mean, x.mean(dims), rtol=0, atol=1e-12)
    torch.testing.assert_close(whole.unbiased_var(), x.var(dims, correction=1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
@pytest.mark.parametrize("sizes", SIZES[1:], ids=str)
def test_commit_equals_batchnorm_on_the_concatenated_batch(momentum: float | None, sizes: tuple[int, ...]) -> None:
    """Three steps: running mean, variance (unbiased over the total count) and num_batches_tracked as torch's."""
    ours = nn.BatchNorm2d(3, momentum=momentum, dtype=torch.float64)
    ref = nn.BatchNorm2d(3, momentum=momentum, dtype=torch.float64)
    for step in range(3):
        x = _batch(sum(sizes), (3, 2, 2), seed=10 + step)
        commit(ours, combine([Moments.of(part) for part in x.split(list(sizes))]))
        with torch.no_grad():
            ref(x)
        for name, b in ref.named_buffers():
            torch.testing.assert_close(dict(ours.named_buffers())[name], b, rtol=1e-12, atol=1e-12)
    assert int(ours.num_batches_tracked) == 3


def test_committing_each_micro_batch_differs_from_committing_the_batch() -> None:
    """The mutant the multi-rank tests must catch: with momentum < 1 and several micro-batches it is not close."""
    x = _batch(14, (4,), seed=0)
    once, each = nn.BatchNorm1d(4, dtype=torch.float64), nn.BatchNorm1d(4, dtype=torch.float64)
    commit(once, combine([Moments.of(p) for p in x.tensor_split(4)]))
    for p in x.tensor_split(4):
        commit(each, Moments.of(p))
    assert (once.running_mean - each.running_mean).abs().max() > 1.0
    assert int(each.num_batches_tracked) == 4


def test_sum_over_replicas_is_the_moments_of_all_replicas() -> None:
    """Three replicas (threads) with an all-reduce made of a barrier: each ends with the moments of all data."""
    data = [_batch(n, (3,), seed=n) for n in (6, 4, 5)]
    slots: list[torch.Tensor | None] = [None] * 3
    barrier = threading.Barrier(3)
    results: list[Moments | None] = [None] * 3

    def replica(r: int) -> None:
        def reduce(t: torch.Tensor) -> None:
            slots[r] = t.clone()
            barrier.wait()
            total = sum(slots)  # type: ignore[arg-type]
            barrier.wait()
            t.copy_(total)

        mine = [Moments.of(data[r])]
        bnm.sum_over_replicas(mine, reduce)
        results[r] = mine[0]

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    x = torch.cat(data)
    for got in results:
        assert got is not None and got.n == 15
        torch.testing.assert_close(got.mean, x.mean(0), rtol=0, atol=1e-12)
        torch.testing.assert_close(got.unbiased_var(), x.var(0), rtol=1e-12, atol=1e-12)


# ---- the option -----------------------------------------------------------------------
def test_bad_option_is_refused_naming_the_values() -> None:
    with pytest.raises(ValueError, match=r"batchnorm= must be one of 'micro', 'deferred'.*'foo'"):
        check_batchnorm("foo")
    with pytest.raises(ValueError, match="across_replicas=True\\) needs mode='deferred'"):
        BatchNormPolicy("micro", across_replicas=True)
    assert check_batchnorm("deferred") == BatchNormPolicy("deferred")
    assert check_batchnorm(None) is None


def test_pipeline_refuses_a_bad_option_before_any_communication() -> None:
    """Raised first, whether or not torch.distributed is initialised: no group is touched."""
    with pytest.raises(ValueError, match="batchnorm="):
        sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, batchnorm="foo", parallel=sw.ParallelConfig(dp=2))


# ---- one rank -------------------------------------------------------------------------
def _make(schedule: str, recompute=None):
    def make(layers: list, **kw):
        return sw.Pipeline(
            layers, loss_fn=F.cross_entropy, schedule=schedule, microbatches=bc.M, recompute=recompute, **kw
        )

    return make


@pytest.mark.parametrize("schedule,recompute", [("1f1b", None), ("zb-h1", "stage"), ("zb-v", 1)])
def test_one_rank_deferred_matches_the_one_process_model(one_rank, schedule: str, recompute) -> None:
    bc.train_and_compare(_make(schedule, recompute))


def test_one_rank_micro_fails_the_deferred_comparison(one_rank) -> None:
    with pytest.raises(AssertionError):
        bc.train_and_compare(_make("1f1b"), steps=1, mode="micro", expect=bc.DEFERRED)


def test_one_rank_micro_is_torch_per_micro_batch(one_rank) -> None:
    """The reference the replicas' averaging is checked against: with one replica, torch's update once per
    micro-batch, in order (num_batches_tracked M per step)."""
    bc.train_and_compare(_make("1f1b"), mode="micro")


def test_micro_with_recompute_updates_once_per_micro_batch(one_rank) -> None:
    """Recompute re-runs the forward in the backward; the statistics are still updated once per micro-batch."""
    plain = sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, microbatches=bc.M, batchnorm="micro")
    again = sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, microbatches=bc.M, batchnorm="micro", recompute=1)
    x, y = bc.data(bc.BATCH, seed=0)
    plain.train_step(x, y)
    again.train_step(x, y)
    for (name, a), (_, b) in zip(plain.named_buffers(), again.named_buffers()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    assert int(again.get_buffer("1.num_batches_tracked")) == bc.M


@pytest.mark.parametrize("mode", ["deferred", "micro"])
def test_update_bn_estimates_the_statistics_again_as_the_one_process_model_would(one_rank, mode: str) -> None:
    bc.update_bn_and_compare(_make("1f1b"), mode)


def test_update_bn_of_something_else_than_a_pipeline_says_what_it_takes() -> None:
    with pytest.raises(TypeError, match=r"takes a stagewise Pipeline as pipe, got Linear"):
        sw.runtime.update_bn([torch.zeros(2, 3)], nn.Linear(3, 3))


def test_direct_calls_outside_a_step_are_plain_batchnorm(one_rank) -> None:
    pipe = sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, microbatches=bc.M, batchnorm="deferred")
    bn = pipe.get_submodule("1")
    bn(torch.randn(6, bc.D, dtype=torch.float64))
    assert int(bn.num_batches_tracked) == 1 and bn.track_running_stats


def test_detection_message_once_unless_chosen(one_rank, caplog: pytest.LogCaptureFixture) -> None:
    bnm._announced = False
    with caplog.at_level(logging.WARNING, logger="stagewise.runtime.features.batchnorm"):
        sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, microbatches=bc.M, batchnorm="micro")
        assert not caplog.records
        for _ in range(2):
            sw.Pipeline(bc.bn_layers(), loss_fn=F.cross_entropy, microbatches=bc.M)
    texts = [r.getMessage() for r in caplog.records]
    assert len(texts) == 1, texts
    assert "3 BatchNorm1d" in texts[0] and "batchnorm='deferred'" in texts[0] and "batchnorm='micro'" in texts[0]


@pytest.mark.parametrize("mode", ["deferred", "micro"])
def test_eval_step_in_training_mode_updates_as_a_training_forward(one_rank, mode: str) -> None:
    """As a forward in training mode does in one process: ``eval_step`` with the layers training updates the
    running statistics as a train step's forwards would (deferred: once over the batch, num_batches_tracked + 1;
    micro: once per micro-batch); in eval mode it leaves them alone."""
    layers = bc.bn_layers()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, microbatches=bc.M, batchnorm=mode)
    ref = sw.build_model(layers)
    x, y = bc.data(bc.BATCH, seed=5)
    pipe.eval()
    pipe.eval_step(x)
    assert all(int(t) == 0 for n, t in pipe.named_buffers() if n.endswith("num_batches_tracked"))
    pipe.train()
    pipe.eval_step(x)
    bc.reference_step(ref, x, y, bc.M, policy=BatchNormPolicy(mode))  # (its gradients unused)
    bc.assert_params_close(pipe, ref, f"eval_step in training mode ({mode})", buffers=True)
    tracked = {int(t) for n, t in pipe.named_buffers() if n.endswith("num_batches_tracked")}
    assert tracked == {1 if mode == "deferred" else bc.M}, tracked
