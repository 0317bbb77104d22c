"""torch 2.13's FSDP2 warning "returned a view tensor", ignored by stagewise's sharding exactly (its message), and
only that one (runtime/hybrid/sharding.py says why it is harmless there). One process, a one-rank group."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def _run(layer: nn.Module) -> None:
    layer(torch.randn(2, 3, 4, dtype=torch.float64)).sum().backward()  # 3-d input, bias: FSDP2's output is a view


def test_fsdp2s_view_warning_is_ignored_for_stagewise_units_and_only_it(one_rank: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stagewise.runtime.hybrid import sharding

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("sharding",))
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        _run(fully_shard(nn.Linear(4, 4).double(), mesh=mesh))  # torch alone: it warns
        assert any("returned a view tensor" in str(w.message) for w in seen), [str(w.message) for w in seen]
        seen.clear()
        layer = nn.Linear(4, 4).double()
        sharding.shard_layers([layer], mesh)
        _run(layer)
        warnings.warn("FSDP2 says something else", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["FSDP2 says something else"]


def test_an_in_place_op_on_the_view_still_trains_exactly(one_rank: object) -> None:
    """What the warning fears, done: ``out += 1`` on a unit's view output drops FSDP2's pre-backward hook. Under
    stagewise's driving (parameters gathered until SYNC, reduction by hand) the gradients are still the model's."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from stagewise.runtime.hybrid import sharding
    from stagewise.runtime.hybrid.tensor_parallel import full

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("sharding",))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()
    model = copy.deepcopy(ref)
    sharding.shard_layers(list(model), mesh)
    xs = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    for x in xs:  # two micro-batches, then the step's reduction
        hidden = model[0](x)
        hidden += 1.0  # in place, on FSDP2's view output
        model[1](hidden).pow(2).sum().backward()
        (ref[1](ref[0](x) + 1.0)).pow(2).sum().backward()
    sharding.reduce(list(model))
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.grad), r.grad, rtol=1e-13, atol=1e-14, msg=name)
