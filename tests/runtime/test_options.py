"""One options value for every way in: its fields, its checks, a misspelt name, what a way in refuses.

All refusals here happen before any process group exists (no torch.distributed is set up in this module).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import stagewise as sw
from stagewise.runtime.frontends.from_model import FromModel
from stagewise.runtime.frontends.given import GivenStages
from stagewise.runtime.frontends.layer_list import LayerList
from stagewise.runtime.options import OPTION_NAMES, Options, PipelineOptions, check_applicable


def test_the_keyword_types_list_every_option_once() -> None:
    """The options are documented once, in the Options docstring; the fields are the source, and the TypedDict
    editors and type checkers read has each, in order, with the same type."""
    assert tuple(PipelineOptions.__annotations__) == OPTION_NAMES
    assert "given" not in OPTION_NAMES and len(set(OPTION_NAMES)) == len(OPTION_NAMES)
    fields = {f.name: f.type for f in dataclasses.fields(Options) if f.name != "given"}
    typed = {k: getattr(v, "__forward_arg__", v) for k, v in PipelineOptions.__annotations__.items()}
    assert typed == fields
    doc = Options.__doc__ or ""
    unexplained = [name for name in OPTION_NAMES if not re.search(rf"``{name}(``|\(|=)", doc)]
    assert unexplained == [], f"options the Options docstring does not explain: {unexplained}"


def test_a_misspelt_option_is_named_with_the_closest_valid_one() -> None:
    with pytest.raises(
        TypeError, match=r"Pipeline\(layers\): unknown option 'microbatchs' \(did you mean 'microbatches'\?\)"
    ):
        Options.of("Pipeline(layers)", None, {"microbatchs": 4})
    with pytest.raises(TypeError, match=r"unknown option 'zzz'"):
        Options.of("Pipeline.from_hf", None, {"zzz": 1})
    with pytest.raises(TypeError, match="unknown option 'nan_polcy' \\(did you mean 'nan_policy'\\?\\)"):
        sw.Pipeline([nn.Linear(2, 2)], nan_polcy="skip")  # before any process group is asked for


def test_given_options_are_remembered_and_keywords_override_a_reused_value() -> None:
    base = sw.Options(schedule="zb-v", microbatches=8)
    assert base.given == frozenset()  # built directly: nothing marked, every default is explicit
    opts = Options.of("Pipeline(layers)", base, {"microbatches": 4, "timeout": 30.0})
    assert (opts.schedule, opts.microbatches, opts.timeout) == ("zb-v", 4, 30.0)
    assert opts.is_given("timeout") and not opts.is_given("seed")
    assert opts.with_defaults(timeout=1.0, seed=3).timeout == 30.0  # given wins over a way in's default
    assert opts.with_defaults(seed=3).seed == 3


@pytest.mark.parametrize(
    ("keywords", "error", "words"),
    [
        ({"microbatches": 0}, ValueError, "microbatches must be an integer >= 1"),
        ({"stages": True}, ValueError, "stages must be an integer >= 1"),
        ({"schedule": 3}, TypeError, "schedule must be a registered name or a stagewise.Schedule"),
        ({"timeout": 0}, ValueError, "timeout must be > 0 seconds"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        ({"partition": "fast"}, ValueError, "partition must be 'balanced', 'uniform'"),
        ({"partition": [2, 0]}, ValueError, "every stage needs at least one layer, but stage 1 has 0"),
        ({"speeds": [1.0, -1.0]}, ValueError, "speeds must be finite numbers > 0"),
        ({"speeds": [1.0, float("inf")]}, ValueError, "speeds must be finite numbers > 0"),  # (it was accepted)
        ({"memory_caps": [float("inf")] * 2}, ValueError, "memory_caps must be finite numbers > 0"),
        ({"memory_caps": "big"}, TypeError, "memory_caps must be a sequence of numbers"),
        ({"nan_policy": "ignore"}, ValueError, "nan_policy must be one of"),
        ({"batchnorm": "sync"}, ValueError, "batchnorm= must be one of"),
        ({"recompute": "all"}, ValueError, "recompute must be None, 'stage' or a positive layer count"),
        ({"autocast": torch.int8}, ValueError, "autocast"),
        ({"optimizer": 3}, TypeError, "optimizer must be a factory"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be a function"),
        ({"emulate_slowdown": 0.5}, ValueError, "emulate_slowdown factors must be numbers >= 1"),
        ({"emulate_slowdown": [1.0, float("inf")]}, ValueError, "emulate_slowdown factors must be numbers >= 1"),
        ({"memory_caps": ["16", "1GiB"]}, ValueError, "memory_caps[0] 16: give a unit, e.g. 16GiB"),
        ({"memory_caps": ["1 parsec", 2]}, ValueError, "memory_caps[0]: unknown unit 'parsec'"),
        ({"memory_caps": ["inf", "1GiB"]}, ValueError, "memory_caps must be finite numbers > 0"),
        ({"group": object(), "parallel": sw.ParallelConfig(pp=1)}, ValueError, "pass either group= or parallel="),
    ],
)
def test_bad_values_are_refused_naming_the_option(keywords: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=re.escape(words)):
        Options.of("Pipeline(layers)", None, keywords)


def test_memory_caps_take_sizes_written_with_a_unit() -> None:
    opts = Options.of("Pipeline(layers)", None, {"memory_caps": ["1.5GiB", "512 MiB", 1000.0]})
    assert list(opts.memory_caps) == [1.5 * 2**30, 512 * 2**20, 1000.0]  # bytes, as a number means
    assert Options.of("Pipeline(layers)", opts, {"seed": 1}).memory_caps == opts.memory_caps  # reused: stays bytes


def test_a_way_in_refuses_only_what_it_cannot_apply_and_only_when_given() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    given = Options.of("Pipeline.from_model", None, {"seed": 3})
    with pytest.raises(ValueError, match="Pipeline.from_model does not take seed=: the model's weights exist"):
        check_applicable("Pipeline.from_model", FromModel(model).refused, given)
    check_applicable("Pipeline.from_model", FromModel(model).refused, Options())  # the default seed: fine
    stages = GivenStages({0: nn.Linear(2, 2)})
    both = Options.of(stages.entry, None, {"partition": "time", "free_unused": False})
    with pytest.raises(ValueError, match="from_stages does not take partition=: the stages are cut already") as err:
        check_applicable(stages.entry, stages.refused, both)
    assert "does not take free_unused=" in str(err.value)  # every refused option is named at once
    layers = LayerList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"Pipeline\(layers\) does not take concrete_args="):
        check_applicable(layers.entry, layers.refused, Options.of(layers.entry, None, {"concrete_args": {}}))


def test_from_stages_refuses_a_tied_spec_it_cannot_see_across_ranks() -> None:
    with pytest.raises(ValueError, match="stage 0 holds a sw.Tied: a tie across ranks is invisible"):
        GivenStages({0: [sw.Tied("embed", nn.Embedding(4, 2)), nn.Linear(2, 2)]})
    with pytest.raises(TypeError, match="takes a mapping"):
        GivenStages([nn.Linear(2, 2)])  # type: ignore[arg-type]
