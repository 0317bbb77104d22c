"""The default cut's runtime half: the work counted on the meta device, and the one warning when the named
schedule is predicted slower than 1F1B (issue 49 item 1)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.partition import CountedLayer, Rates, estimated_profile
from stagewise.passes import build_schedule
from stagewise.runtime.frontends import default_cut
from stagewise.runtime.frontends.layers import named_layers
from stagewise.runtime.measure.counting import count_layers


def test_a_linear_layer_counts_its_multiply_adds_and_its_backward_twice() -> None:
    """Linear(4, 8) on 2 samples: 2 x 2 x 4 x 8 = 128 FLOPs forward; the input and weight gradients 128 each."""
    named = named_layers([sw.Layer(nn.Linear, 4, 8, bias=False), sw.Layer(nn.ReLU)])
    (lin, relu) = count_layers(["a", "b"], lambda k: named[k][1].build(k), torch.randn(2, 4))
    assert (lin.forward_flops, lin.backward_flops) == (128, 256)
    assert (lin.parameters, lin.parameter_bytes, lin.output_bytes) == (32, 128, 64)
    assert relu.forward_flops == 0 and relu.forward_bytes > 0 and relu.parameters == 0
    assert lin.forward_ops >= 1 and lin.backward_ops >= 1
    # one operator each forward, moving its arguments and result (the transpose a view: nothing), and nothing for
    # a fake tensor's questions about itself (its device: ``prim``)
    assert (lin.forward_ops, lin.forward_bytes, relu.forward_ops, relu.forward_bytes) == (1, 32 + 128 + 64, 1, 128)


class _Scaled(nn.Module):
    """A linear layer times a table kept as a plain attribute (not a buffer: the count cannot swap it for a ``meta``
    one), and one that refuses to read its input's values unless the input is fake (as transformers' masks do)."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        table = torch.arange(8.0, device="cpu")  # (real even when built under the count's meta device)
        if as_buffer:
            self.register_buffer("table", table)
        else:
            self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(x) and x.sum().item() > 1e9:  # a data-dependent branch, skipped for a traced input
            return x
        return self.lin(x) * self.table


def test_a_real_table_and_a_value_read_are_counted_as_the_layer_would_be() -> None:
    """The count runs on fake ``meta`` tensors: a layer that reads a value where its input is not traced takes its
    traced path, and a real tensor the layer keeps outside its state meets the ``meta`` ones as one of them; the
    count equals the same layer's with the table as a buffer."""
    plain, kept = (count_layers(["s"], lambda k, b=b: _Scaled(b), torch.randn(2, 4))[0] for b in (False, True))
    assert plain == kept and plain.forward_flops == 128 and plain.forward_ops >= 2


@pytest.fixture(autouse=True)
def nothing_said() -> Iterator[None]:
    """The warning is given once per process: each test starts with none given."""
    default_cut._SAID.clear()
    yield
    default_cut._SAID.clear()


def _gpt_like() -> default_cut.LayerProfile:
    def layer(name: str, flops: float, params: float = 1.0) -> CountedLayer:
        return CountedLayer(name, flops, 2 * flops, 0.0, 0.0, 0, 0, params, 4 * params, 0.0)

    blocks = [layer(f"block{k}", 1e6) for k in range(8)]
    return estimated_profile([layer("tokens", 1e3), *blocks, layer("head", 2e5, 0.0)], Rates(1e9, 1e9, 0.0))


@pytest.mark.parametrize("rank", [0, 1])
def test_one_warning_on_rank_0_when_the_cut_makes_the_named_schedule_lose(
    rank: int, caplog: pytest.LogCaptureFixture
) -> None:
    zbv = build_schedule("zb-v", 2, 8, 2)
    even = default_cut.DefaultCut([3, 2, 3, 2], _gpt_like(), "counted")  # rank 1 holds 5 blocks, rank 0 3
    balanced = default_cut.DefaultCut([3, 2, 2, 3], _gpt_like(), "counted")
    with caplog.at_level(logging.WARNING, logger="stagewise.runtime.frontends.default_cut"):
        default_cut.warn_if_slower(zbv, even, rank)
        default_cut.warn_if_slower(zbv, balanced, rank)
        default_cut.warn_if_slower(zbv, default_cut.DefaultCut([3, 2, 3, 2], None, "parameters"), rank)
    lines = [r.getMessage() for r in caplog.records]
    if rank != 0:
        assert lines == []
        return
    assert len(lines) == 1 and "schedule 'zb-v' is predicted" in lines[0] and "cuts [3, 2, 3, 2] and" in lines[0]


def test_every_layer_list_gets_a_cut_that_adds_up() -> None:
    """Rank 0's decision as data: what crosses ranks reads back the same."""
    named = named_layers([sw.Layer(nn.Linear, 8, 8) for _ in range(6)])
    cut = default_cut.decide(
        named, build_schedule("zb-v", 2, 4, 2), sample_inputs=torch.randn(2, 8), speeds=None, seed=0, device="cpu"
    )
    assert (
        sum(cut.counts) == 6 and cut.source == "counted" and cut.counts == [2, 2, 1, 1]
    )  # even, and each rank holds 3
    assert default_cut.unplain(default_cut.plain(cut)) == cut


def test_the_same_warning_is_given_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    """A benchmark or an elastic job building the same pipeline again is not told again; another cut is."""
    zbv = build_schedule("zb-v", 2, 8, 2)
    with caplog.at_level(logging.WARNING, logger="stagewise.runtime.frontends.default_cut"):
        for counts in ([3, 2, 3, 2], [3, 2, 3, 2], [3, 3, 2, 2], [3, 2, 3, 2]):
            default_cut.warn_if_slower(zbv, default_cut.DefaultCut(counts, _gpt_like(), "counted"), 0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "cuts [3, 2, 3, 2] and" in lines[0] and "cuts [3, 3, 2, 2] and" in lines[1], lines


class _Conv(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(a, b, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def test_without_inputs_a_convolution_keeps_the_even_cut(caplog: pytest.LogCaptureFixture) -> None:
    """Parameters growing 4-fold per layer would cut [3, 1] (the old default); with a convolution among the
    layers they stand for nothing without an input: the even cut, and an info line saying how to do better.
    Dense layers of the same parameter counts are still cut by parameters."""
    convs = named_layers([sw.Layer(_Conv, 1 << k, 2 << k) for k in range(4)])
    dense = named_layers([sw.Layer(nn.Linear, 3 << k, 6 << k) for k in range(4)])
    one_f_one_b = build_schedule("1f1b", 2, 4)
    kw = {"sample_inputs": None, "speeds": None, "seed": 0, "device": "cpu"}
    with caplog.at_level(logging.INFO, logger="stagewise.runtime.frontends.default_cut"):
        cut = default_cut.decide(convs, one_f_one_b, **kw)  # type: ignore[arg-type]
    assert (cut.counts, cut.source, cut.profile) == ([2, 2], "parameters", None)
    assert any("holds a convolution" in r.getMessage() and "sample_inputs=" in r.getMessage() for r in caplog.records)
    assert default_cut.decide(dense, one_f_one_b, **kw).counts == [3, 1]  # type: ignore[arg-type]


class _Strided(nn.Module):
    def __init__(self, a: int, b: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(a, b, 3, stride=stride, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


#: five convolutions on 32 x 32 images: the second does 2.4 MFLOP-pairs per sample, the last two 0.15 each, so
#: the even cut [3, 2] gives rank 0 nearly all the work; the counted cut moves the boundary to [2, 3]
CONVS = [(1, 16, 1), (16, 16, 1), (16, 16, 2), (16, 16, 2), (16, 16, 1)]


class _Recorder:
    """What the first batch does to a pipeline, without processes: its re-layouts."""

    def __init__(self, layers: list[sw.Layer], schedule: str, rank: int) -> None:
        from stagewise.runtime.frontends.layer_list import LayerList
        from stagewise.runtime.options import Options

        self.frontend = LayerList(layers)
        self.options = Options(loss_fn=nn.functional.cross_entropy)
        self.schedule = build_schedule(schedule, 2, 4)
        self.layer_ranges = [range(0, 3), range(3, 5)]
        self.train_steps, self.pp_rank, self.device, self.replanned_cut = 0, rank, torch.device("cpu"), None
        self.prior_wanted = False  # (a Pipeline's: no calibrator asked)
        self.transport = type("T", (), {"group": None})()
        self.moves: list[list[int]] = []
        self.held = [nn.Parameter(torch.zeros(2))]  # a parameter of this rank's layers
        self.optimizers: dict[int, torch.optim.Optimizer] = {0: torch.optim.SGD(self.held, lr=0.1)}  # its own

    def parameters(self) -> list[nn.Parameter]:
        return self.held

    def relayout(self, *, partition: list[int]) -> None:
        self.moves.append(partition)
        self.layer_ranges = [range(sum(partition[:k]), sum(partition[: k + 1])) for k in range(len(partition))]


def _timed(times: list[float]) -> default_cut.LayerProfile:
    """A profile as the profiler would give it, with chosen times (forward a third, backward two thirds)."""
    layers = [CountedLayer(f"c{k}", t / 3, 2 * t / 3, 0.0, 0.0, 0, 0, 1.0, 4.0, 0.0) for k, t in enumerate(times)]
    return estimated_profile(layers, Rates(1.0, 1e12, 0.0), loss_passes=0.0)


#: the times the fake profiler reports for CONVS: the last layer the slowest by far, as no count says (the
#: counted cut is [2, 3], the time cut [4, 1])
TIMES = [1e-3, 1e-3, 1e-3, 1e-3, 5e-3]


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The first rank's decision handed round as if by two ranks (the collective itself: the 2-rank check
    ``default-cut`` in tests/distributed/workers/from_model_checks.py); its timing replaced by fixed times
    (the real profiler: that check), each call's inputs recorded."""
    from stagewise.runtime.frontends import first_batch

    timed: list[Any] = []

    def fake(named: Any, inputs: Any, **kw: Any) -> default_cut.LayerProfile:
        timed.append(inputs)
        return _timed(TIMES[: len(named)])

    monkeypatch.setattr(default_cut, "timed_profile", fake)
    monkeypatch.setattr(first_batch, "on_first_rank", lambda group, fn, *a, **k: fn())
    monkeypatch.setattr(first_batch, "_anyone", lambda pipe, flag: flag)
    monkeypatch.setattr(first_batch.groups, "group_size", lambda group: 2)
    monkeypatch.setattr(first_batch.groups, "world_size", lambda: 2)
    return timed


def test_a_convolution_list_is_cut_by_the_first_batch_timed_work(
    one_process: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """No sample inputs: built evenly ([3, 2]: a convolution's work is unknown without an image); the first
    train step's first micro-batch (4 images of 32 x 32 of the batch's 16, 4 micro-batches) is timed layer by
    layer, and the pipeline moves to the time cut before the step, recorded as the run's own: not to the
    counted cut, [2, 3], by the convolutions' multiply-adds (2 x 9 x in x out x output positions per image)."""
    from stagewise.runtime.frontends import first_batch

    layers = [sw.Layer(_Strided, a, b, s) for a, b, s in CONVS]
    pipe = _Recorder(layers, "1f1b", rank=0)
    x = torch.randn(16, 1, 32, 32)
    counted = count_layers([f"c{k}" for k in range(5)], lambda k: layers[k].build(), x[:4])
    positions = [32 * 32, 32 * 32, 16 * 16, 8 * 8, 8 * 8]
    assert [c.forward_flops for c in counted] == [4 * 2 * 9 * a * b * n for (a, b, _), n in zip(CONVS, positions)]
    assert default_cut.cut_by(estimated_profile(counted, Rates(1e9, 1e12, 0.0)), pipe.schedule) == [2, 3]
    assert first_batch.pending(pipe)
    with caplog.at_level(logging.INFO, logger="stagewise.runtime.frontends.first_batch"):
        first_batch.at_first_batch(pipe, [(x, None)])
    assert [tuple(t.shape) for t in one_process] == [(4, 1, 32, 32)]  # the first micro-batch, timed once
    assert default_cut.cut_by(_timed(TIMES), pipe.schedule) == [4, 1]
    assert pipe.moves == [[4, 1]] and pipe.replanned_cut == [4, 1]
    assert pipe.layer_profile == _timed(TIMES)  # the profile the cut came from: what a calibration scales
    assert any("timed work cuts the layers [4, 1] (was [3, 2])" in r.getMessage() for r in caplog.records)
    assert not first_batch.pending(pipe)  # decided once: a resume takes the recorded cut back
    first_batch.at_first_batch(pipe, [(x, None)])
    assert pipe.moves == [[4, 1]] and len(one_process) == 1


def test_a_transformers_model_is_cut_by_the_first_batch_counted_work(one_process: list[Any]) -> None:
    """``from_hf`` without ``sample_inputs`` is cut by the parameters each decoder layer multiplies with, which
    cannot see attention's work over the sequence's square: on sequences of 256 a small llama's layers weigh more
    against its head than their parameters say, ``[5, 1]`` by parameters. At the first batch its decoder layers are
    counted on ``meta`` (not timed) and the pipeline moves to the counted cut, recorded as the run's own."""
    pytest.importorskip("transformers")
    import transformers as tf

    from stagewise.runtime.frontends import first_batch
    from stagewise.runtime.frontends.hf import FromHF

    config = tf.LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # (the global generator left as the other tests find it)
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(config)
        ids = torch.randint(0, 1024, (8, 256))
    pipe = _Recorder([sw.Layer(nn.Linear, 4, 4)], "1f1b", rank=0)  # (its layer list replaced by the model)
    pipe.frontend, pipe.layer_ranges, pipe.layer_profile = FromHF(model, check=False), [range(0, 5), range(5, 6)], None
    assert first_batch.pending(pipe)
    first_batch.at_first_batch(pipe, [(ids, None)])
    want = default_cut.decide(pipe.frontend.units(), pipe.schedule, sample_inputs=ids[:2], speeds=None, seed=0,
                              device="cpu")  # fmt: skip
    by_parameters = default_cut.decide(pipe.frontend.units(), pipe.schedule, sample_inputs=None, speeds=None, seed=0,
                                       device="cpu")  # fmt: skip
    assert by_parameters.counts == [5, 1] and want.source == "counted" and want.counts[0] < 5, want.counts
    assert pipe.moves == [want.counts] and pipe.replanned_cut == want.counts and pipe.layer_profile == want.profile
    assert one_process == [] and not first_batch.pending(pipe)  # counted, not timed; decided once


def test_without_inputs_a_table_looked_up_is_no_work_and_a_tied_head_is() -> None:
    """The default without sample inputs weighs a layer by the parameters it multiplies with: the GPT's token table
    (a look-up) none, its tied head (``h @ table.T``) the whole table, a module tied and called again as often as
    it is called, a parameter both looked up and multiplied once."""
    vocab, d = 512, 16

    class Both(nn.Module):  # a table and a product over it, one parameter (a transformers tied head in one unit)
        def __init__(self) -> None:
            super().__init__()
            self.table, self.out = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
            self.out.weight = self.table.weight

    layers = [
        sw.Tied("tokens", sw.Layer(nn.Embedding, vocab, d)),
        sw.Tied("block", sw.Layer(nn.Linear, d, d)),
        sw.Tied("block"),
        sw.Layer(Both),
        sw.Tied("tokens", forward_fn=lambda table, h: h @ table.weight.T),
    ]
    named = named_layers(layers)
    built = [default_cut._on_meta(x) for _, x in named]
    assert default_cut.multiplied_parameters(named, built) == [0, d * d + d, d * d + d, vocab * d, vocab * d]


def test_a_large_vocabulary_s_llama_is_cut_by_parameters_as_its_counted_work_cuts_it() -> None:
    """Without sample inputs the build's cut of a llama whose vocabulary outweighs a layer (8192 x 256: the head
    about two and a half layers of work, the embedding none) is the cut its counted work gives, for the plain and
    the V schedules: the embedding's table counted as work gave the first rank a layer too few (``[4, 4]``)."""
    pytest.importorskip("transformers")
    import transformers as tf

    from stagewise.runtime.frontends.hf import FromHF

    config = tf.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                            num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        units = FromHF(tf.LlamaForCausalLM(config), check=False).units()
    ids = torch.zeros(4, 64, dtype=torch.long)
    for schedule in (build_schedule("1f1b", 2, 8), build_schedule("zb-v", 2, 8, 2)):
        by_parameters = default_cut.decide(units, schedule, sample_inputs=None, speeds=None, seed=0, device="cpu")
        counted = default_cut.decide(units, schedule, sample_inputs=ids, speeds=None, seed=0, device="cpu")
        assert counted.source == "counted" and by_parameters.counts == counted.counts, (schedule.name, counted.counts)
    assert by_parameters.counts != [2, 2, 2, 2]


def test_with_sample_inputs_convolutions_are_timed_and_dense_layers_counted(one_process: list[Any]) -> None:
    """The rule (:func:`stagewise.planning.defaults.pricing`) where the cut is built: a list holding a
    convolution is cut by its timed profile, handed round with it; dense layers by their count, untimed."""
    convs = named_layers([sw.Layer(_Strided, a, b, s) for a, b, s in CONVS])
    kw: dict[str, Any] = {"speeds": None, "seed": 0, "device": "cpu"}
    cut = default_cut.decide(convs, build_schedule("1f1b", 2, 4), sample_inputs=torch.randn(4, 1, 32, 32), **kw)
    assert (cut.counts, cut.source, cut.profile) == ([4, 1], "timed", _timed(TIMES))
    assert default_cut.unplain(default_cut.plain(cut)) == cut
    dense = named_layers([sw.Layer(nn.Linear, 8, 8) for _ in range(4)])
    assert default_cut.decide(dense, build_schedule("1f1b", 2, 4), sample_inputs=torch.randn(2, 8), **kw).source == (
        "counted"
    )
    assert len(one_process) == 1  # the dense list was never timed


def test_an_optimizer_of_the_user_s_keeps_the_cut(one_process: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """The README's pattern, ``AdamW(pipe.parameters())`` before the first step: a re-layout would leave it
    holding tensors nobody trains, so the even cut is kept and rank 0 says how to get the counted one. The
    pipeline's own optimizers (``optimizer=``) move with the cut: they do not hold it back."""
    from stagewise.runtime.frontends import first_batch

    layers = [sw.Layer(_Strided, a, b, s) for a, b, s in CONVS]
    pipe = _Recorder(layers, "1f1b", rank=0)
    assert not first_batch._held_outside(pipe)
    mine = torch.optim.AdamW(pipe.parameters())
    assert first_batch._held_outside(pipe)
    with caplog.at_level(logging.INFO, logger="stagewise.runtime.frontends.first_batch"):
        first_batch.at_first_batch(pipe, [(torch.randn(16, 1, 32, 32), None)])
    assert pipe.moves == [] and pipe.replanned_cut is None and mine.param_groups
    assert pipe.layer_profile == _timed(TIMES)  # the cut kept, the layers' times known all the same
    assert any("timed work would cut the layers [4, 1]; [3, 2] is kept" in r.getMessage() for r in caplog.records)


def test_nothing_waits_for_the_first_batch_where_the_cut_was_asked_for(one_process: list[Any]) -> None:
    from stagewise.runtime.frontends import first_batch
    from stagewise.runtime.options import Options

    layers = [sw.Layer(_Strided, a, b, s) for a, b, s in CONVS]
    for options in (Options(partition="uniform"), Options(sample_inputs=torch.randn(4, 1, 32, 32))):
        pipe = _Recorder(layers, "1f1b", rank=0)
        pipe.options = options
        first_batch.at_first_batch(pipe, [(torch.randn(16, 1, 32, 32), None)])
        assert pipe.moves == [] and not first_batch.pending(pipe)
    trained = _Recorder(layers, "1f1b", rank=0)
    trained.train_steps = 3  # a resumed run: its cut is the record's
    assert not first_batch.pending(trained)


def test_without_sample_inputs_the_first_batch_gives_the_word(
    one_process: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Dense layers (cut by parameters at build, nothing to re-cut): rank 0 counts the first micro-batch and,
    the runtime's work per action priced, says that ZB-V on twelve small layers is predicted slower than 1F1B;
    rank 1 (no inputs) says nothing and moves nothing."""
    from stagewise.runtime.frontends import first_batch

    layers = [sw.Layer(nn.Linear, 32, 32) for _ in range(12)]
    said = []
    for rank, inputs in ((0, torch.randn(16, 32)), (1, None)):
        pipe = _Recorder(layers, "1f1b", rank=rank)
        pipe.schedule = build_schedule("zb-v", 2, 8, 2)
        pipe.layer_ranges = [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stagewise.runtime.frontends.default_cut"):
            first_batch.at_first_batch(pipe, [(inputs, None)])
        said.append([r.getMessage() for r in caplog.records])
        assert pipe.moves == []
    assert len(said[0]) == 1 and "schedule 'zb-v' is predicted" in said[0][0] and said[1] == []


def test_from_model_balanced_with_sample_inputs_times_a_convolution_model(
    one_process: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Pipeline.from_model``'s default (``"balanced"``) with ``sample_inputs`` over a model whose blocks are
    convolutions: the blocks themselves (already built) are timed on the sample (one micro-batch), and the
    blocks are cut by that time ([4, 1]), not by their count ([2, 3]) nor evenly ([3, 2])."""
    from stagewise.runtime.frontends import from_model
    from stagewise.runtime.options import Options

    monkeypatch.setattr(from_model, "on_first_rank", lambda group, fn, *a, **k: fn())
    monkeypatch.setattr(from_model.groups, "group_rank", lambda group: 0)
    model = nn.Sequential(*[_Strided(a, b, s) for a, b, s in CONVS])
    x = torch.randn(4, 1, 32, 32)
    counts, measured = from_model._block_counts(model, build_schedule("1f1b", 2, 4), Options(sample_inputs=x), None)
    assert counts == [4, 1] and measured == _timed(TIMES)  # the blocks' times kept: what a calibration scales
    assert len(one_process) == 1 and one_process[0] is x  # timed once, on the sample itself


def test_a_calibrator_s_prior_is_priced_at_the_first_batch_of_a_hand_cut(one_process: list[Any]) -> None:
    """A pipeline cut by hand has no profile; a RunCalibrator built before the first step asks for one
    (``prior_wanted``), and the first batch's first micro-batch is counted on the meta device, as the default
    cut counts it, handed to every rank (here: one process) and kept as the pipeline's ``layer_profile``: the
    wide layer priced far above the narrow ones, where the flat prior would price them alike. Asked once; a
    pipeline no calibrator asked for is not priced."""
    from stagewise.runtime.frontends import first_batch
    from stagewise.runtime.options import Options

    layers = [sw.Layer(nn.Linear, 64, 64), sw.Layer(nn.Linear, 64, 4096), sw.Layer(nn.Linear, 4096, 64)] + [
        sw.Layer(nn.Linear, 64, 64) for _ in range(2)
    ]
    x = torch.randn(64, 64)
    for wanted in (False, True):
        pipe = _Recorder(layers, "1f1b", rank=0)
        pipe.options, pipe.layer_profile, pipe.prior_wanted = Options(partition=[3, 2]), None, wanted
        assert not first_batch.pending(pipe)  # a hand cut: nothing to decide
        first_batch.at_first_batch(pipe, [(x, None)])
        if not wanted:
            assert pipe.layer_profile is None
            continue
        named = named_layers(layers)
        assert pipe.layer_profile == default_cut.priced(named, x[:16], seed=0, device="cpu")[0]
        times = pipe.layer_profile.times()
        assert times[1] > 5 * times[0] and times[2] > 5 * times[3], times
        assert not pipe.prior_wanted and pipe.moves == [] and one_process == []  # counted, not timed
        first_batch.at_first_batch(pipe, [(torch.randn(256, 64), None)])  # another shape  # asked once: kept as priced
        assert pipe.layer_profile == default_cut.priced(named, x[:16], seed=0, device="cpu")[0]


def test_a_model_s_blocks_are_priced_at_the_first_batch_for_a_calibrator(one_process: list[Any]) -> None:
    """``Pipeline.from_model`` without ``sample_inputs`` (cut by parameters, no profile): the first batch counts its
    top-level blocks block to block, as its default cut counts them on ``sample_inputs``; a tagged model (its
    stages' modules, no blocks) is left to the flat prior."""
    from types import SimpleNamespace

    from stagewise.runtime.frontends import first_batch

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096), nn.Linear(4096, 64), nn.Linear(64, 64))
    x = torch.randn(64, 64)
    for blocks in (("0", "1", "2", "3"), ()):
        pipe = _Recorder([sw.Layer(nn.Linear, 4, 4)], "1f1b", rank=0)  # (its layer list replaced by the model)
        pipe.frontend, pipe.model_cut = SimpleNamespace(model=model), SimpleNamespace(blocks=blocks)
        pipe.layer_ranges, pipe.layer_profile, pipe.prior_wanted = [range(0, 2), range(2, 4)], None, True
        first_batch.at_first_batch(pipe, [(x, None)])
        if not blocks:
            assert pipe.layer_profile is None
            continue
        named = [(str(k), m) for k, m in enumerate(model)]
        assert pipe.layer_profile == default_cut.priced(named, x[:16], seed=0, device="cpu")[0]
        times = pipe.layer_profile.times()
        assert pipe.layer_profile.names == list(blocks) and times[1] > 5 * times[0] and times[2] > 5 * times[3]


def test_a_pricing_that_fails_leaves_the_even_spread_and_the_step(
    one_process: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the pricing raises on rank 0 is logged, and every rank goes on with no profile (the flat prior):
    the first step never fails for its sake."""
    from stagewise.runtime.frontends import first_batch

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("a layer nobody can run on meta")

    monkeypatch.setattr(default_cut, "priced", broken)
    pipe = _Recorder([sw.Layer(nn.Linear, 8, 8) for _ in range(5)], "1f1b", rank=0)
    pipe.layer_profile, pipe.prior_wanted = None, True
    first_batch.at_first_batch(pipe, [(torch.randn(16, 8), None)])
    assert pipe.layer_profile is None and not pipe.prior_wanted
