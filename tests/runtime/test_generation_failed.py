"""The line of a survivor of an in-place job whose generation failed (stagewise.runtime.elastic.generation_failed):
the lost machines and workers, the step and what happens next in stagewise's words; gloo's text, which names a
C++ file and an address, stays out of it and goes to the file the line names."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagewise.runtime.elastic.generation_failed import file_error, in_words
from stagewise.runtime.interrupt import TRACEBACK_ENV

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:42"
WHAT = "global rank 1: the data-parallel gradient all-reduce of stage 0 failed"


@pytest.mark.parametrize(
    "named",
    [
        "global rank 2 stopped or died (no sign of life for 2.5 s)",
        "global rank 2 stopped or died (process gone: its port refuses connections)",
    ],
)
def test_a_named_loss_is_said_in_stagewises_words_and_gloos_text_is_left_out(named: str) -> None:
    message = f"{named}: {WHAT}: {GLOO}\nmore of gloo"
    line = in_words(message, "PipelineError", (0, 4), [0, 1, 2], 1, "/tmp/t/attempt-0/rank-1.7.generation-0.txt")
    assert line == (
        f"generation 0 failed at step 4: lost machine 2 (worker 2); {WHAT}. The survivors agree on the next "
        "generation without it and go on from the last committed step (the error in full: "
        "/tmp/t/attempt-0/rank-1.7.generation-0.txt)"
    )


def test_ranks_are_the_generations_and_machines_come_from_the_workers_ids() -> None:
    message = "global ranks 1, 2 stopped or died (no sign of life for 6.0 s); global rank 0 waited 10.1 s for x"
    line = in_words(message, "PipelineError", (3, 9), [0, 1, 4, 5, 6, 7], 2, "f.txt")  # ids 1 and 4: machines 0, 2
    assert line.startswith("generation 3 failed at step 9: lost machines 0, 2 (workers 1, 4); global rank 0 waited")
    assert "without them" in line
    unknown = in_words("global rank 1 stopped or died: x failed: y", "E", (0, 1), [0, 1], 0, "f")  # no machine size
    assert "lost worker 1; x failed. " in unknown


def test_torchs_own_text_is_not_the_cause_and_without_a_file_the_error_is_said() -> None:
    line = in_words(GLOO, "RuntimeError", (0, 4), [0, 1, 2], 1, "f.txt")
    assert "/__w/" not in line and "a RuntimeError inside torch. The survivors agree" in line
    assert "without it" not in line and "lost" not in line
    bare = in_words(f"{WHAT}: {GLOO}", "PipelineError", (0, 4), [0, 1], 1, "")
    assert bare.endswith(f"(the error: {WHAT}: {GLOO})")  # nowhere else to read it


def test_the_error_goes_beside_the_workers_traceback_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACEBACK_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        raise RuntimeError(GLOO)
    except RuntimeError as err:
        where = file_error(err, 3)
    assert Path(where).parent == tmp_path / "attempt-0" and where.endswith(".generation-3.txt")
    text = Path(where).read_text()
    assert text.startswith("Traceback (most recent call last)") and GLOO in text
    monkeypatch.delenv(TRACEBACK_ENV)
    assert file_error(RuntimeError("x"), 3) == ""  # outside stagewise run


def test_a_silent_member_posted_by_the_stamps_is_named_without_the_rest():
    """The in-place step's silence post (relayout.generation._post_silent) reads as a lost machine, not as text."""
    from stagewise.runtime.comm.faults import heartbeat

    posted = heartbeat.blame([(2, 3.2)]).removesuffix(")") + " on the job's store: its machine stopped or was cut off)"
    line = in_words(f"stage 0: the step's wait failed: {posted}", "RuntimeError", (1, 7), [0, 1, 2, 3], 2, "")
    assert line.startswith("generation 1 failed at step 7: lost machine 1 (worker 2); stage 0: the step's wait failed")
    assert "cut off" not in line.split("(the error")[0], line


def test_a_failure_naming_no_one_names_the_dead_found_after_it_and_keeps_torchs_text_out():
    """A snapshot's copy cut off by the lost machine fails with gloo's text after stagewise's and names no rank
    (2026-12-06, a new user's run: the line carried gloo's C++ location, its address and "GLHF"): the line says
    what failed in stagewise's words and names the workers the recovery found gone (``lost``)."""
    cut = f"rank 0: the snapshot of step 223: PipelineError: waiting for the snapshots' copies: RuntimeError: {GLOO}"
    line = in_words(cut + " (snapshot=)", "PipelineError", (0, 224), [0, 1, 2, 3], 2, "f.txt", lost=[3, 2])
    assert line.startswith(
        "generation 0 failed at step 224: lost machine 1 (workers 2, 3); rank 0: the snapshot of step 223: "
        "PipelineError: waiting for the snapshots' copies: a RuntimeError inside torch. The survivors agree on the "
        "next generation without them"
    ), line
    assert "pair.cc" not in line and "10.0.0.3" not in line
    unnamed = in_words(cut, "PipelineError", (0, 224), [0, 1, 2, 3], 2, "f.txt")  # nothing found: no one named
    assert "lost" not in unnamed and "copies: a RuntimeError inside torch." in unnamed
