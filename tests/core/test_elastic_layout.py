"""Elastic jobs, the pure parts: the layout that follows the world size, which snapshot generation a resume takes
and who reads which file, ``stagewise run --nnodes MIN:MAX``'s launch arguments, and what a failed rendezvous
says. (Snapshots on ranks: tests/distributed/test_snapshots.py; machines lost: tests/system/test_elastic.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import stagewise as sw
from stagewise.cli.main import main
from stagewise.runtime.elastic.choose import Copy, Need, choose
from stagewise.runtime.elastic.launch import rendezvous_failure

# ---- ElasticLayout -------------------------------------------------------------------------------------


def test_layout_keeps_the_global_batch_at_every_size() -> None:
    layout = sw.ElasticLayout(pp=2, batch=24, microbatch_size=2)
    for world in layout.sizes():
        fit = layout.at(world)
        assert fit.parallel.world_size == world and fit.parallel.pp == 2
        assert fit.parallel.replicas * fit.microbatches * fit.microbatch_size == 24
        assert fit.microbatch_size == 2
    assert layout.at(8).describe() == "pp 2 x dp 4" and layout.at(2).describe() == "pp 2"


def test_layout_with_fixed_microbatches_adjusts_their_rows() -> None:
    layout = sw.ElasticLayout(pp=2, batch=24, microbatches=4)
    assert layout.sizes() == (2, 4, 6, 12)
    assert [(layout.at(w).microbatches, layout.at(w).microbatch_size) for w in (2, 4, 6)] == [(4, 6), (4, 3), (4, 2)]


def test_layout_with_tensor_and_sharded_axes() -> None:
    layout = sw.ElasticLayout(pp=2, batch=16, microbatch_size=2, tp=2, sharding=2)
    fit = layout.at(16)
    assert (fit.parallel.pp, fit.parallel.dp, fit.parallel.sharding, fit.parallel.tp) == (2, 2, 2, 2)
    assert fit.microbatches == 2  # 16 rows over 4 replicas, micro-batches of 2
    assert fit.describe() == "pp 2 x dp 2 x sharding 2 x tp 2"


@pytest.mark.parametrize(
    ("world", "words"),
    [
        (5, "cannot use 5 processes (not a multiple of pp 2 x sharding 1 x tp 1 = 2); it can use 2, 4, 6, 8, 12 or 24"),
        (10, "(pp 2 x dp 5: 24 rows do not split into 5 replicas)"),
        (32, "(pp 2 x dp 16: 24 rows do not split into 16 replicas)"),
    ],
)
def test_a_size_the_layout_cannot_use_is_refused_naming_those_it_can(world: int, words: str) -> None:
    with pytest.raises(ValueError, match="ElasticLayout") as err:
        sw.ElasticLayout(pp=2, batch=24, microbatch_size=2).at(world)
    assert words in str(err.value)


def test_layout_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="one of microbatch_size="):
        sw.ElasticLayout(pp=2, batch=24)
    with pytest.raises(ValueError, match="ElasticLayout.pp must be a positive int"):
        sw.ElasticLayout(pp=0, batch=24, microbatches=2)
    with pytest.raises(ValueError, match="cannot use any number of processes"):
        sw.ElasticLayout(pp=2, batch=24, microbatch_size=5).at(2)


# ---- choosing a generation -----------------------------------------------------------------------------
def copy(machine: str, owner: int, step: int, names: set[str], lineage: str = "aa", world: int = 4) -> Copy:
    holder = {"m0": 0, "m1": 2, "m2": 4}[machine]
    path = f"/shm/{step}-{lineage}-{owner}"
    return Copy(machine, holder, path, lineage, step, owner, world, {"w": world}, frozenset(names))


STAGE0, STAGE1 = {"model/a", "param:a"}, {"model/b", "param:b"}


def generation(step: int, lineage: str = "aa") -> list[Copy]:
    """pp 2 x dp 2 on two machines (ranks 0-1 on m0 hold stage 0 and 1 of replica 0 ...), each file also on the
    other machine."""
    names = [STAGE0, STAGE1, STAGE0, STAGE1]
    machine = ["m0", "m0", "m1", "m1"]
    other = {"m0": "m1", "m1": "m0"}
    out = []
    for r in range(4):
        out.append(copy(machine[r], r, step, names[r], lineage))
        out.append(copy(other[machine[r]], r, step, names[r], lineage))
    return out


NEEDS = [Need(0, "m0", frozenset(STAGE0)), Need(1, "m0", frozenset(STAGE1)), Need(2, "m1", frozenset(STAGE0))]
NEEDS += [Need(3, "m1", frozenset(STAGE1))]


def test_the_newest_generation_that_covers_every_rank_wins() -> None:
    files = generation(2) + generation(4)
    choice = choose(files, NEEDS, {"w": 4}, set())
    assert choice is not None and (choice.step, choice.rng) == (4, True)
    assert [c.owner for c in choice.reads[2]] == [2]  # the same layout: each rank its own file (generators)
    assert all(c.machine == "m1" for c in choice.reads[2]) and choice.transfers == []  # read where it lies


def test_a_lost_machine_is_covered_by_its_peers_copies() -> None:
    files = [c for c in generation(2) + generation(4) if c.machine != "m1"]
    needs = [Need(0, "m0", frozenset(STAGE0)), Need(1, "m0", frozenset(STAGE1))]  # two processes left
    choice = choose(files, needs, {"w": 2}, set())
    assert choice is not None and choice.step == 4 and not choice.rng  # another layout: no generators
    assert [c.owner for c in choice.reads[0]] == [0] and choice.transfers == []


def test_a_new_machine_receives_its_files_in_one_order() -> None:
    files = [c for c in generation(4) if c.machine == "m0"]
    needs = [*NEEDS[:2], Need(2, "m2", frozenset(STAGE0)), Need(3, "m2", frozenset(STAGE1))]
    choice = choose(files, needs, {"w": 4}, set())
    assert choice is not None and choice.rng  # every owner's file is on m0
    assert [(h, r, c.owner) for h, r, c in choice.transfers] == [(0, 2, 2), (0, 3, 3)]


def test_an_incomplete_or_refused_generation_is_passed_over() -> None:
    newest = [c for c in generation(6) if c.owner != 1]  # stage 1's replica 0 never written at step 6 ...
    newest = [c for c in newest if not (c.owner == 3 and c.machine == "m1")]  # ... and replica 1 only on m0
    files = generation(4) + newest
    choice = choose(files, NEEDS, {"w": 4}, set())
    assert choice is not None and choice.step == 6 and not choice.rng  # stage 1 from rank 3's copy on m0
    refused = {(c.machine, c.path) for c in newest if c.owner == 3}
    choice = choose(files, NEEDS, {"w": 4}, refused)
    assert choice is not None and choice.step == 4 and choice.rng


def test_lineages_never_mix_and_nothing_covers_gives_none() -> None:
    half = [c for c in generation(8, "bb") if c.owner in (0, 1)] + [c for c in generation(8, "cc") if c.owner > 1]
    assert choose(half, NEEDS, {"w": 4}, set()) is not None  # each lineage alone covers stage 0 and 1 ...
    only_a = [c for c in generation(8, "bb") if c.owner == 0] + [c for c in generation(8, "cc") if c.owner == 3]
    assert choose(only_a, NEEDS, {"w": 4}, set()) is None  # ... but two lineages' halves are not one state


# ---- stagewise run --nnodes MIN:MAX ----------------------------------------------------------------------
def test_run_elastic_arguments(launched: tuple[Path, list[tuple[list[str], dict[str, str]]]]) -> None:
    script, calls = launched
    argv = ["run", "-n", "2", "--nnodes", "2:4", "--max-restarts", "3", "--rdzv-endpoint", "10.0.0.9:29400"]
    conf = "--rdzv-conf=join_timeout=60,last_call_timeout=5"
    assert main([*argv, "--rdzv-id", "j6", "--rdzv-host", "--rdzv-conf", conf[12:], str(script), "--x"]) == 0
    assert main([*argv, "--rdzv-id", "job7", "--local-addr", "10.0.0.2", str(script)]) == 0
    head = ["--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.9:29400"]
    fast = "keep_alive_interval=1,keep_alive_max_attempt=3"  # the defaults the user's --rdzv-conf leaves unset
    assert calls[0][0] == [
        *head, "--rdzv-id=j6", f"--rdzv-conf=is_host=true,join_timeout=60,last_call_timeout=5,{fast}",
        "--max-restarts=3", "--nproc-per-node=2", str(script), "--x",
    ]  # fmt: skip
    assert calls[1][0] == [
        *head, "--rdzv-id=job7", f"--rdzv-conf=is_host=false,{fast},last_call_timeout=2", "--local-addr=10.0.0.2",
        "--max-restarts=3", "--nproc-per-node=2", str(script),
    ]  # fmt: skip
    assert calls[0][1]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a fresh store per round's workers
    assert calls[0][1]["STAGEWISE_NNODES"] == "2:4"  # the workers' env.world_sizes: 4, 6 and 8


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--nnodes", "2"], "needs --node-rank I and --rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in 0..1"),
        (["--nnodes", "0"], "--nnodes must be >= 1"),
        (["--nnodes", "2:3", "--rdzv-endpoint", "h:1"], "give --max-restarts N"),
        (["--nnodes", "2:3", "--max-restarts", "1"], "needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2:3", "--max-restarts", "1", "--rdzv-endpoint", "h:1", "--node-rank", "0"], "drop --node-rank"),
        (["--nnodes", "3:2"], "--nnodes must be >= 1 (M, or MIN:MAX with MIN <= MAX)"),
        (["--nnodes", "a:b"], "--nnodes takes M or MIN:MAX"),
        (["--rdzv-host"], "--rdzv-host is for --nnodes MIN:MAX"),
        (
            [
                "--nnodes",
                "1:2",
                "--max-restarts",
                "1",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-id",
                "j",
                "--rdzv-conf",
                "is_host=1",
            ],
            "is set by",
        ),
        (
            [
                "--nnodes",
                "1:2",
                "--max-restarts",
                "1",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-id",
                "j",
                "--rdzv-conf",
                "oops",
            ],
            "KEY=VALUE",
        ),
        (["--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint", "h:1"], "needs --rdzv-id ID: the job's name"),
    ],
)
def test_run_refuses_bad_launch_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], words: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert main(["run", "-n", "2", *argv, str(script)]) == 2
    assert words in capsys.readouterr().err


def test_rendezvous_refuses_a_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rendezvous", "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


class RendezvousTimeoutError(Exception):
    pass


class RendezvousConnectionError(Exception):
    pass


def test_a_failed_rendezvous_says_why_and_what_to_do() -> None:
    nodes = (2, 3, True)
    timeout = rendezvous_failure(RendezvousTimeoutError("timed out"), "h:29400", nodes, "join_timeout=20")
    assert timeout.startswith("fewer than 2 machines (--nnodes 2:3) joined the rendezvous store at h:29400 within ")
    assert "join_timeout=20 s" in timeout and "Start the missing machines" in timeout
    gone = rendezvous_failure(RendezvousConnectionError("refused"), "h:29400", nodes)
    assert "the rendezvous store at h:29400 is unreachable" in gone and "stagewise rendezvous --port" in gone
    assert "\n" not in gone + timeout


def test_every_size_the_job_may_reach_is_checked_at_the_start() -> None:
    """The guide's old ``batch=16`` under ``-n 8 --nnodes 2:3``: 16 processes fit, 24 do not - refused at the
    first round, before a machine is ever lost or added."""
    from types import SimpleNamespace

    from stagewise.parallel import world_sizes

    sizes = world_sizes("2:3", 8, 16)
    assert sizes == (16, 24) and world_sizes("", 8, 16) == (16,) and world_sizes("3:2", 8, 16) == (16,)
    layout = sw.ElasticLayout(pp=2, batch=16, microbatch_size=2)
    assert layout.at(16).describe() == "pp 2 x dp 8"  # the size of this round alone fits
    with pytest.raises(ValueError, match="cannot use 24 processes, which this job may reach") as err:
        layout.at(SimpleNamespace(world_size=16, world_sizes=sizes))
    assert "(its sizes: 16 or 24)" in str(err.value) and "12 replicas" in str(err.value)
    fit = sw.ElasticLayout(pp=2, batch=48, microbatch_size=2).at(SimpleNamespace(world_size=16, world_sizes=sizes))
    assert (fit.world, fit.microbatches) == (16, 3)


def test_rendezvous_mints_a_job_name() -> None:
    from stagewise.cli.rendezvous import ready_line

    one, two = ready_line("10.0.0.9", 29400), ready_line("10.0.0.9", 29400)
    assert "--rdzv-endpoint 10.0.0.9:29400 --rdzv-id job-" in one and one != two
