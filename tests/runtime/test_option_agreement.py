"""What ranks compare before building a pipeline (stagewise.runtime.assembly.agreement), in one process; the
collective itself is tests/distributed/test_runtime_4ranks.py::test_ranks_built_alike_or_refused."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.runtime.assembly.agreement import described, differences, schedule_digest
from stagewise.runtime.options import Options


def _options(**given: object) -> Options:
    return Options.of("Pipeline(layers)", None, {"loss_fn": F.cross_entropy, **given})


def test_what_each_rank_may_set_for_itself_is_left_out() -> None:
    a = described(_options(device="cpu", timeout=5.0, sample_inputs=torch.zeros(2)))
    b = described(_options(device="cuda:1", timeout=60.0))
    assert a == b
    assert {"device", "timeout", "sample_inputs", "group", "store"}.isdisjoint(a)


def test_options_are_plain_values() -> None:
    d = described(_options(microbatches=4, autocast=torch.bfloat16, parallel=sw.ParallelConfig(pp=2, dp=2)))
    assert d["microbatches"] == 4 and d["autocast"] == "torch.bfloat16" and d["loss_fn"] == "<function>"
    assert d["parallel"].startswith("ParallelConfig(") and "pp=2" in d["parallel"] and "dp=2" in d["parallel"]


def test_differences_name_each_option_and_who_holds_what() -> None:
    base = described(_options(microbatches=4))
    other = described(_options(microbatches=2, schedule="gpipe"))
    found = differences([base, base, other, base])
    assert found == [
        'schedule: ranks 0, 1, 3 have "1f1b"; rank 2 has "gpipe"',
        "microbatches: ranks 0, 1, 3 have 4; rank 2 has 2",
    ]
    assert differences([base, base]) == []


def test_the_schedule_digest_tells_action_lists_apart() -> None:
    one = sw.build_schedule("1f1b", 2, 4)
    assert schedule_digest(one) == schedule_digest(sw.build_schedule("1f1b", 2, 4))
    assert schedule_digest(one) != schedule_digest(sw.build_schedule("1f1b", 2, 2))
    assert schedule_digest(one) != schedule_digest(sw.build_schedule("gpipe", 2, 4))
