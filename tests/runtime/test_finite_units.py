"""The non-finite screen in one process: it never misses a NaN or an infinity, an overflowing sum is no alarm, and a
refused or skipped step leaves nothing behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise.runtime.errors import PipelineError
from stagewise.runtime.features.finite import Buffers, FiniteCheck, any_non_finite

CPU = torch.device("cpu")


def flagged(*grads: torch.Tensor, losses: tuple[torch.Tensor, ...] = ()) -> bool:
    return bool(any_non_finite(list(losses), list(grads), CPU).item())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_element_is_found_anywhere(dtype: torch.dtype, bad: float) -> None:
    for where in (0, 517, 999):
        g = torch.randn(1000, dtype=torch.float64).to(dtype)
        g[where] = bad
        assert flagged(torch.ones(3), g), (dtype, bad, where)


def test_opposite_infinities_and_clean_tensors() -> None:
    g = torch.zeros(10)
    g[2], g[7] = float("inf"), float("-inf")
    assert flagged(g)
    assert not flagged(torch.randn(100, 100), torch.randn(7, dtype=torch.float64))
    assert flagged(losses=(torch.tensor(float("nan")),))
    assert not flagged(losses=(torch.tensor(2.5),))


def test_half_precision_sums_do_not_overflow_in_half() -> None:
    g = torch.full((1000,), 60000.0, dtype=torch.float16)  # the sum is 6e7: past float16's 65504, fine in float32
    assert not flagged(g)


def _check(policy: str, grad: torch.Tensor) -> tuple[FiniteCheck, nn.Parameter]:
    p = nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    check = FiniteCheck(policy, 0, [("w", p)], {id(p): 0}, lambda flag: None, lambda obj: [obj], CPU)
    return check, p


def test_an_overflowing_finite_sum_is_cleared_by_the_exact_test() -> None:
    grad = torch.full((4,), 3e38, dtype=torch.float32)  # finite; its float32 sum is inf
    assert flagged(grad)
    check, p = _check("raise", grad)
    assert check({}, None) is False
    assert p.grad is grad and check.skipped == 0


def test_a_real_non_finite_gradient_still_raises_and_skips() -> None:
    grad = torch.full((4,), 3e38, dtype=torch.float32)
    grad[3] = float("nan")
    check, _ = _check("raise", grad)
    with pytest.raises(PipelineError, match=r"gradient w\[3\] = nan"):
        check({}, None)
    check, p = _check("skip", grad.clone())
    assert check({}, None) is True and p.grad is None and check.skipped == 1


def test_a_refused_or_skipped_step_puts_every_buffer_back_and_drops_its_gradients() -> None:
    """A NaN sample poisons a BatchNorm's running statistics in the forward; the check puts back every buffer as
    the step found it (the same tensors), under "raise" too, and leaves no gradient (issue 32)."""
    for policy in ("raise", "skip"):
        bn = nn.BatchNorm1d(3, dtype=torch.float64)
        bn(torch.randn(8, 3, dtype=torch.float64))  # running statistics that are not the initial ones
        p = nn.Parameter(torch.zeros(2))
        buffers = Buffers([bn])
        check = FiniteCheck(policy, 0, [("w", p)], {id(p): 0}, lambda f: None, lambda o: [o], CPU, buffers=buffers)
        before = {n: (b, b.clone()) for n, b in bn.named_buffers()}
        check.begin()
        x = torch.randn(8, 3, dtype=torch.float64)
        x[3, 1] = float("nan")
        bn(x)
        assert bn.running_mean.isnan().any() and int(bn.num_batches_tracked) == 2
        p.grad = torch.tensor([1.0, float("nan")])
        if policy == "raise":
            with pytest.raises(PipelineError, match=r"gradient w\[1\] = nan"):
                check({}, None)
        else:
            assert check({}, None) is True
        assert p.grad is None, policy
        for n, b in bn.named_buffers():
            assert b is before[n][0] and torch.equal(b, before[n][1]), (policy, n)
