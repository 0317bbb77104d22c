"""The one-process reference of asynchronous training against numbers derived by hand from the equations,
on a model of three scalar weights (stage 0: h = a2 a1 x, stage 1: z = b h; loss (z - y)^2), 2 stages, 3
mini-batches of one sample (m = 1). And XPipe's prediction rule against its formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from oracles.async_reference import ReferenceRun, async_reference
from stagewise.runtime.asynchronous.predict import check_predictable, predict

LR, MU = 0.1, 0.5
X = [1.0, -2.0, 0.5]
Y = [0.3, 1.0, -0.7]
A1, A2, B = 0.5, -1.5, 0.8


class Scale(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def layers() -> list[sw.Layer]:
    return [sw.Layer(Scale, A1), sw.Layer(Scale, A2), sw.Layer(Scale, B)]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.tensor([[x]], dtype=torch.float64), torch.tensor([[y]], dtype=torch.float64)) for x, y in zip(X, Y)]


def replay(name: str, opt: str = "sgd", **options: bool) -> ReferenceRun:
    schedule = sw.schedules.async_schedule(name, 2, 3, 1, **options)

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR, momentum=MU if opt == "momentum" else 0.0)

    return async_reference(layers(), schedule, factory, batches(), loss_fn=F.mse_loss, counts=[2, 1])


def weights(run: object) -> tuple[float, float, float]:
    params = dict(run.model.named_parameters())  # type: ignore[attr-defined]
    return params["0.w"].item(), params["1.w"].item(), params["2.w"].item()


def stage1(h: float, y: float, b: float) -> tuple[float, float, float, float]:
    """z, loss, dL/db, dL/dh for z = b h, L = (z - y)^2."""
    z = b * h
    e = 2 * (z - y)
    return z, (z - y) ** 2, e * h, e * b


def stage0_grad(g: float, x: float, a1: float, a2: float) -> tuple[float, float]:
    """(dL/da1, dL/da2) given dL/dh = g for h = a2 a1 x."""
    return g * a2 * x, g * a1 * x


# The order (p = 2, m = 1, N = 3): stage 0 runs F0 F1 B0 S F2 B1 S B2 S, stage 1 F0 B0 S F1 B1 S F2 B2 S.
# Stage 0's forward of i sees max(0, i - 1) updates, stage 1's sees i.


def test_stash_is_the_hand_derived_sequence() -> None:
    a = [(A1, A2)]  # stage 0 versions
    b = [B]
    h0 = a[0][0] * a[0][1] * X[0]
    _, l0, gb0, g0 = stage1(h0, Y[0], b[0])
    b.append(b[0] - LR * gb0)
    h1 = a[0][0] * a[0][1] * X[1]  # F(0, 1) before stage 0's first update
    _, l1, gb1, g1 = stage1(h1, Y[1], b[1])
    b.append(b[1] - LR * gb1)
    d1, d2 = stage0_grad(g0, X[0], *a[0])
    a.append((a[0][0] - LR * d1, a[0][1] - LR * d2))
    h2 = a[1][0] * a[1][1] * X[2]
    _, l2, gb2, g2 = stage1(h2, Y[2], b[2])
    b.append(b[2] - LR * gb2)
    d1, d2 = stage0_grad(g1, X[1], *a[0])  # stashed: mini-batch 1's forward ran on W^(0)
    a.append((a[1][0] - LR * d1, a[1][1] - LR * d2))
    d1, d2 = stage0_grad(g2, X[2], *a[1])
    a.append((a[2][0] - LR * d1, a[2][1] - LR * d2))

    run = replay("pipedream")
    assert run.losses == pytest.approx([l0, l1, l2], abs=1e-14)
    assert weights(run) == pytest.approx((*a[3], b[3]), abs=1e-14)
    assert run.versions_made == [3, 3]

    # without stashing, stage 0's backward of mini-batch 1 runs on W^(1), the weights current then
    none = replay("pipedream", stashing=False)
    assert none.losses == pytest.approx([l0, l1, l2], abs=1e-14)  # the forwards are the same
    d1, d2 = stage0_grad(g1, X[1], *a[1])
    a2_none = (a[1][0] - LR * d1, a[1][1] - LR * d2)
    d1, d2 = stage0_grad(g2, X[2], *a2_none)
    assert weights(none) == pytest.approx((a2_none[0] - LR * d1, a2_none[1] - LR * d2, b[3]), abs=1e-14)
    assert abs(weights(none)[0] - weights(run)[0]) > 1e-5  # far above the 1e-14 tolerance


def test_vertical_sync_and_2bw_are_the_hand_derived_sequence() -> None:
    """Vertical sync: stage 1 runs micro-batch i on the version stage 0 tagged, max(0, i - 1) = 0, 0, 1.
    2BW with m = 1, p = 2 uses max(0, t - 1) on both stages: the same numbers, W(t+1) = W(t) - lr grad f(W(t-1))."""
    a = [(A1, A2)]
    b = [B]
    h0 = A1 * A2 * X[0]
    _, l0, gb0, g0 = stage1(h0, Y[0], b[0])
    b.append(b[0] - LR * gb0)
    h1 = A1 * A2 * X[1]
    _, l1, gb1, g1 = stage1(h1, Y[1], b[0])  # tag 0: stage 1 still uses W^(0)
    b.append(b[1] - LR * gb1)
    d1, d2 = stage0_grad(g0, X[0], *a[0])
    a.append((a[0][0] - LR * d1, a[0][1] - LR * d2))
    h2 = a[1][0] * a[1][1] * X[2]
    _, l2, gb2, g2 = stage1(h2, Y[2], b[1])  # tag 1
    b.append(b[2] - LR * gb2)
    d1, d2 = stage0_grad(g1, X[1], *a[0])
    a.append((a[1][0] - LR * d1, a[1][1] - LR * d2))
    d1, d2 = stage0_grad(g2, X[2], *a[1])
    a.append((a[2][0] - LR * d1, a[2][1] - LR * d2))
    for run in (replay("pipedream", vertical_sync=True), replay("pipedream-2bw")):
        assert run.losses == pytest.approx([l0, l1, l2], abs=1e-14)
        assert weights(run) == pytest.approx((*a[3], b[3]), abs=1e-14)


def test_xpipe_is_the_hand_derived_sequence() -> None:
    """SGD with momentum mu: buf <- mu buf + g, W <- W - lr buf. Stage 0 predicts mini-batch 1 from W^(0) one
    update ahead (no buffer yet: W^(0)), mini-batch 2 from W^(1) one ahead: W^(1) - lr buf_1; stage 1 never
    predicts (0 updates ahead)."""
    b, buf_b = B, 0.0
    a, buf_a = (A1, A2), (0.0, 0.0)
    h0 = A1 * A2 * X[0]
    _, l0, gb0, g0 = stage1(h0, Y[0], b)
    buf_b = gb0
    b = b - LR * buf_b
    h1 = A1 * A2 * X[1]
    _, l1, gb1, g1 = stage1(h1, Y[1], b)
    buf_b = MU * buf_b + gb1
    b = b - LR * buf_b
    grads = stage0_grad(g0, X[0], A1, A2)
    buf_a = grads
    a = (a[0] - LR * buf_a[0], a[1] - LR * buf_a[1])
    pred = (a[0] - LR * buf_a[0], a[1] - LR * buf_a[1])  # W^(1) - lr * 1 * buf
    h2 = pred[0] * pred[1] * X[2]
    _, l2, gb2, g2 = stage1(h2, Y[2], b)
    buf_b = MU * buf_b + gb2
    b = b - LR * buf_b
    grads = stage0_grad(g1, X[1], A1, A2)  # mini-batch 1 ran on the prediction from W^(0): W^(0)
    buf_a = (MU * buf_a[0] + grads[0], MU * buf_a[1] + grads[1])
    a = (a[0] - LR * buf_a[0], a[1] - LR * buf_a[1])
    grads = stage0_grad(g2, X[2], *pred)
    buf_a = (MU * buf_a[0] + grads[0], MU * buf_a[1] + grads[1])
    a = (a[0] - LR * buf_a[0], a[1] - LR * buf_a[1])
    run = replay("xpipe", "momentum")
    assert run.losses == pytest.approx([l0, l1, l2], abs=1e-14)
    assert weights(run) == pytest.approx((*a, b), abs=1e-14)


def test_windows_drain_the_pipeline() -> None:
    """A window of 1 mini-batch is plain sequential SGD: no staleness at all."""
    schedule = sw.schedules.async_schedule("pipedream", 2, 1)

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR)

    run = async_reference(layers(), schedule, factory, batches(), loss_fn=F.mse_loss, counts=[2, 1])
    model = sw.build_model(layers())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for (x, y), got in zip(batches(), run.losses):
        loss = F.mse_loss(model(x), y)
        assert got == pytest.approx(loss.item(), abs=1e-14)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), run.model.named_parameters()):
        assert p.item() == pytest.approx(q.item(), abs=1e-14), n


# ---- the prediction rule -----------------------------------------------------------


def test_adam_prediction_is_the_bias_corrected_direction() -> None:
    for cls, wd in ((torch.optim.Adam, 0.0), (torch.optim.AdamW, 0.1)):
        p = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
        opt = cls([p], lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=wd)
        assert torch.equal(predict(opt, [p], 3)[0], p.detach())  # no state yet: u = 0
        g1, g2 = torch.tensor([0.5, 1.0], dtype=torch.float64), torch.tensor([-0.2, 0.4], dtype=torch.float64)
        for g in (g1, g2):
            p.grad = g.clone()
            opt.step()
        m = 0.2 * (0.8 * g1 + g2)
        v = 0.1 * (0.9 * g1**2 + g2**2)
        u = (m / (1 - 0.8**2)) / ((v / (1 - 0.9**2)).sqrt() + 1e-8) + wd * p.detach()
        torch.testing.assert_close(predict(opt, [p], 3)[0], p.detach() - 0.01 * 3 * u, rtol=0, atol=1e-15)


def test_optimizers_without_a_rule_are_refused() -> None:
    p = [nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="no weight-prediction rule for the optimizer RMSprop"):
        check_predictable(torch.optim.RMSprop(p))
    with pytest.raises(ValueError, match="SGD needs momentum > 0"):
        check_predictable(torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ValueError, match="nesterov=True"):
        check_predictable(torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))
    with pytest.raises(ValueError, match="amsgrad=True"):
        check_predictable(torch.optim.Adam(p, amsgrad=True))
    check_predictable(torch.optim.AdamW(p))


def test_reference_refuses_a_synchronous_schedule() -> None:
    with pytest.raises(ValueError, match="not asynchronous"):
        async_reference(layers(), sw.build_schedule("1f1b", 2, 2), torch.optim.SGD, batches(), loss_fn=F.mse_loss)


# ---- a whole asynchronous pipeline on one rank ---------------------------------------
@pytest.mark.parametrize(
    "name,options", [("pipedream", {}), ("pipedream", {"stashing": False}), ("pipedream-2bw", {}), ("xpipe", {})]
)
def test_one_rank_async_pipeline_matches_the_reference(one_rank, name: str, options: dict[str, bool]) -> None:
    """One stage: no staleness except 2BW's designed delay; train_stream equals the reference, and by name too."""

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR, momentum=MU)

    schedule = sw.schedules.async_schedule(name, 1, 2, 1, **options)
    pipe = sw.Pipeline(layers(), loss_fn=F.mse_loss, schedule=schedule, optimizer=factory)
    losses = list(pipe.train_stream(batches(), steps=3))
    ref = async_reference(layers(), schedule, factory, batches(), loss_fn=F.mse_loss)
    assert losses == pytest.approx(ref.losses, abs=1e-15)
    got = dict(pipe.named_parameters())
    for n, q in ref.model.named_parameters():
        assert got[n].item() == pytest.approx(q.item(), abs=1e-15), n
    assert list(pipe.train_stream(batches(), steps=0)) == []
    with pytest.raises(ValueError, match="train with train_stream"):
        pipe.train_step(*batches()[0])


def test_2bw_with_two_microbatches_differentiates_the_version_before_the_last() -> None:
    """p = 2, m = 2, N = 2: both mini-batches run on W(0) at both stages (max(0, t - 1) = 0), so
    W(1) = W(0) - lr g_0(W(0)) and W(2) = W(1) - lr g_1(W(0)); each micro-batch's loss weighs 1/2."""
    xs = [[1.0, -2.0], [0.5, 1.5]]
    ys = [[0.3, 1.0], [-0.7, 0.2]]

    def grads(t: int) -> tuple[float, float, float, float]:
        """(loss, dL/da1, dL/da2, dL/db) of mini-batch t at W(0)."""
        loss = ga1 = ga2 = gb = 0.0
        for x, y in zip(xs[t], ys[t]):
            h = A1 * A2 * x
            _, l_k, gb_k, g_k = stage1(h, y, B)
            d1, d2 = stage0_grad(g_k, x, A1, A2)
            loss, ga1, ga2, gb = loss + l_k / 2, ga1 + d1 / 2, ga2 + d2 / 2, gb + gb_k / 2
        return loss, ga1, ga2, gb

    l0, a1_0, a2_0, b_0 = grads(0)
    l1, a1_1, a2_1, b_1 = grads(1)
    expected = (A1 - LR * (a1_0 + a1_1), A2 - LR * (a2_0 + a2_1), B - LR * (b_0 + b_1))
    data = [
        (
            torch.tensor([[x] for x in xs[t]], dtype=torch.float64),
            torch.tensor([[y] for y in ys[t]], dtype=torch.float64),
        )
        for t in range(2)
    ]
    schedule = sw.schedules.async_schedule("pipedream-2bw", 2, 2, 2)

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR)

    run = async_reference(layers(), schedule, factory, data, loss_fn=F.mse_loss, counts=[2, 1])
    assert run.losses == pytest.approx([l0, l1], abs=1e-14)
    assert weights(run) == pytest.approx(expected, abs=1e-14)
