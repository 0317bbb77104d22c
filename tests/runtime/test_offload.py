"""offload="optimizer": the optimizer's state (and float32 masters of half parameters) in a host buffer of its own,
the update run there, exact against the plain optimizer in float64.

On a CPU the "host" is the same memory as the "device", so where the state lives is proven by storage identity:
every optimizer state tensor sits in a storage the offload allocated, none in a parameter's or a gradient's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from helpers import models as mdl
from stagewise.runtime.features.offload import Offload

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def momentum(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _state_tensors(pipe: sw.Pipeline) -> list[torch.Tensor]:
    return [v for opt in pipe.optimizers.values() for st in opt.state.values() for v in st.values() if v.dim() > 0]


def assert_state_on_the_host(pipe: sw.Pipeline) -> None:
    """Every state tensor lives in a storage the offload allocated; no parameter or gradient storage holds any."""
    offload = pipe.hooks.stepper
    assert isinstance(offload, Offload)
    state = _state_tensors(pipe)
    assert state, "the optimizer holds no state: the check would prove nothing"
    host = _storages(t for h in offload.hosts.values() for t in h.host_tensors())
    grads = [p.grad for p in pipe.parameters() if p.grad is not None]
    device = _storages(pipe.parameters()) | _storages(grads)
    assert _storages(state) <= host, "an optimizer state tensor outside the offload's host buffers"
    assert not (host & device), "the offload's host buffers share storage with the device's parameters or gradients"
    for opt in pipe.optimizers.values():  # between steps the optimizer shows the device parameters, keyed as usual
        params = [p for g in opt.param_groups for p in g["params"]]
        assert {id(p) for p in params} <= {id(p) for p in pipe.parameters()}
        assert all(id(k) in {id(p) for p in params} for k in opt.state)


@pytest.mark.parametrize("factory", [adamw, momentum], ids=["adamw", "sgd-momentum"])
@pytest.mark.parametrize("schedule,v", [("interleaved-1f1b", 2), ("zb-v", 2), ("gpipe", 1)])
def test_offloaded_training_equals_the_plain_optimizer(one_rank, factory: Factory, schedule: str, v: int) -> None:
    layers = mdl.mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule=schedule, microbatches=4, virtual_stages=v,
                       optimizer=factory, offload="optimizer", seed=3)  # fmt: skip
    ref = sw.build_model(layers, seed=3)
    opt = factory(list(ref.parameters()))
    for step in range(3):
        x, y = mdl.mlp_data(8, seed=step)
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        want = F.cross_entropy(ref(x), y)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-12)
        ref_params = dict(ref.named_parameters())
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-12, atol=1e-14)
        assert_state_on_the_host(pipe)
    assert all(p.grad is None for p in pipe.parameters()), "the device's gradients must be freed at STEP"


def test_half_parameters_update_float32_masters_on_the_host(one_rank) -> None:
    """A bfloat16 model: the host keeps float32 masters, the update accumulates there, the device gets each
    master rounded. Reference: the same rule by hand (bf16 forward and backward, float32 AdamW on masters)."""
    layers = mdl.mlp(dtype=torch.bfloat16)
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="gpipe", microbatches=1, optimizer=adamw,
                       offload="optimizer", seed=3)  # fmt: skip
    ref = sw.build_model(layers, seed=3)
    masters = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    opt = adamw(masters)  # type: ignore[arg-type]
    plain = sw.build_model(layers, seed=3)  # bf16 AdamW on bf16 weights: what the masters are for
    plain_opt = adamw(list(plain.parameters()))
    for step in range(4):
        x, y = mdl.mlp_data(8, seed=step, dtype=torch.bfloat16)
        pipe.train_step(x, y)
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        plain_opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()
    host = pipe.hooks.stepper.hosts[0]  # type: ignore[attr-defined]
    assert all(h.local.dtype == torch.float32 for h in host.params)
    for h, m in zip(host.params, masters):
        assert torch.equal(h.local, m.detach()), "the host's float32 masters differ from the rule's"
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), q.detach()), n
    assert all(v.dtype == torch.float32 for v in _state_tensors(pipe))
    drift = max((p.float() - q.float()).abs().max().item() for p, q in zip(pipe.parameters(), plain.parameters()))
    assert drift > 0, "bf16 weights updated in bf16 equal the masters' rounding: the test could not tell them apart"


def test_a_parameter_written_in_place_refreshes_its_master(one_rank) -> None:
    """A write the offload did not make (a checkpoint load, HetPipe's wave) is seen through the version counter:
    the next update starts from the written value, as the plain optimizer's would."""
    layers = mdl.mlp()
    pipe = sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="gpipe", microbatches=2, optimizer=momentum,
                       offload="optimizer", seed=3)  # fmt: skip
    ref = sw.build_model(layers, seed=3)
    opt = momentum(list(ref.parameters()))
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                for p, q in zip(pipe.parameters(), ref.parameters()):
                    p.mul_(0.5)
                    q.mul_(0.5)
        x, y = mdl.mlp_data(8, seed=step)
        pipe.train_step(x, y)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)


def test_the_optimizer_state_round_trips_through_a_checkpoint(one_rank, tmp_path: Any) -> None:
    """Saved from the host, loaded back to the host (not to the parameters' device or dtype), training on alike."""
    layers = mdl.mlp()

    def build(seed: int) -> sw.Pipeline:
        return sw.Pipeline(layers, loss_fn=F.cross_entropy, schedule="gpipe", microbatches=2, optimizer=adamw,
                           offload="optimizer", seed=seed)  # fmt: skip

    a, b = build(3), build(4)
    a.train_step(*mdl.mlp_data(8, seed=0))
    sw.checkpoint.save(tmp_path / "ck", a, step=1)
    sw.checkpoint.load(tmp_path / "ck", b)
    assert_state_on_the_host(b)
    x, y = mdl.mlp_data(8, seed=1)
    assert a.train_step(x, y) == b.train_step(x, y)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_offload_is_refused_without_an_optimizer_or_by_a_wrong_name() -> None:
    with pytest.raises(ValueError, match="offload='optimizer' moves the optimizer's state to the host: it needs"):
        sw.Options(offload="optimizer")
    with pytest.raises(ValueError, match="offload must be None or 'optimizer'"):
        sw.Options(offload="params", optimizer=adamw)
    with pytest.raises(TypeError, match="did you mean 'offload'"):
        sw.Options.of("Pipeline", None, {"offlaod": "optimizer"})
