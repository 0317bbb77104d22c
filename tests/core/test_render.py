"""Renderers: PNG Gantt chart, Chrome/Perfetto trace and ASCII chart of simulated and measured timelines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

import stagewise as sw
from stagewise.ir import Action, Event, Kind, Schedule, Timeline, loop_placement, parse_action
from stagewise.render import render_ascii, render_png, render_stack, render_trace, stack_figure, timeline_figure
from stagewise.simulation import CostModel, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulated(name: str, p: int, m: int, **costs: float) -> Timeline:
    schedule = sw.build_schedule(name, p, m)
    return simulate(schedule, CostModel.uniform(schedule.num_stages, **costs)).timeline


def interleaved_gpipe(p: int, m: int, v: int) -> Timeline:
    """A two-stages-per-rank timeline that does not depend on the registered interleaved schedules."""
    ranks = []
    for r in range(p):
        acts = [Action(c * p + r, Kind.F, i) for c in range(v) for i in range(m)]
        acts += [Action(c * p + r, Kind.B, i) for c in reversed(range(v)) for i in range(m)]
        ranks.append(tuple(acts))
    return simulate(Schedule("gpipe-chunks", m, loop_placement(p, v), tuple(ranks))).timeline


def measured() -> Timeline:
    """What the runtime feeds in: real seconds, uneven durations, communication waits."""
    raw = [
        (0, "0F0", 0.0, 0.0103),
        (0, "0SEND_F0", 0.0103, 0.0105),
        (0, "0F1", 0.0105, 0.0211),
        (1, "1RECV_F0", 0.0, 0.0107),
        (1, "1F0", 0.0107, 0.0215),
        (1, "1B0", 0.0215, 0.0431),
        (1, "1F1", 0.0431, 0.0540),
        (1, "1B1", 0.0540, 0.0752),
        (0, "0RECV_B0", 0.0211, 0.0433),
        (0, "0B0", 0.0433, 0.0650),
        (0, "0B1", 0.0756, 0.0969),
        (0, "0SYNC", 0.0969, 0.0991),
    ]
    events = [Event(r, parse_action(a), s, e) for r, a, s, e in raw]
    return Timeline(name="1f1b", num_ranks=2, events=events, source="measured", unit="s")


# ---- ASCII --------------------------------------------------------------------------

GPIPE_2_2 = """\
rank 0  F0 F1 .  .  .  B0--- B1---
rank 1  .  F0 F1 B0--- B1--- .  ."""


def test_ascii_golden_gpipe_p2_m2() -> None:
    timeline = simulated("gpipe", 2, 2)  # F = I = W = 1, so B = 2
    assert render_ascii(timeline) == GPIPE_2_2
    assert render_ascii(simulate(sw.schedules.generate("gpipe", 2, 2)).timeline) == GPIPE_2_2


def test_ascii_is_deterministic_and_fits_the_width() -> None:
    timeline = simulated("1f1b", 8, 40, comm_time=0.3)
    text = render_ascii(timeline, width=90)
    assert text == render_ascii(Timeline.from_json(json.loads(timeline.dumps())), width=90)
    lines = text.splitlines()
    assert len(lines) == 8 and all(len(line) <= 90 for line in lines)


def test_ascii_compact_chart_when_labels_do_not_fit() -> None:
    text = render_ascii(simulated("gpipe", 2, 4), width=24)  # makespan 15, room for 16 characters
    # 16 cells of 15/16: rank 0 forwards over [0, 4), backwards over [7, 15)
    assert text == "rank 0  FFFF...BBBBBBBBB\nrank 1  .FFFFBBBBBBBBB.."


def test_ascii_quantum_follows_half_unit_transfers() -> None:
    text = render_ascii(simulated("gpipe", 2, 2, comm_time=0.5), width=200)
    assert text.splitlines()[1].startswith("rank 1  .  .  .  F0--- F1--- B0")


def test_ascii_names_the_stage_with_several_stages_per_rank() -> None:
    text = render_ascii(interleaved_gpipe(2, 2, 2), width=200)
    assert text.splitlines()[0].startswith("rank 0  0F0 0F1 2F0 2F1 ")
    assert "3B1" in text.splitlines()[1]


def test_ascii_of_a_measured_timeline() -> None:
    text = render_ascii(measured(), width=80)
    # uneven real times: cells of the shortest action (10.3 ms), every action still shown
    assert text == "rank 0  F0 F1 .  .  B0--- .  B1--- SY\nrank 1  .  F0 B0--- F1 B1--- .  .  ."
    compact = render_ascii(measured(), width=30).splitlines()
    assert [len(line) for line in compact] == [30, 30]
    assert compact[0].startswith("rank 0  FFFF") and compact[1].startswith("rank 1  ..F")


def test_ascii_of_an_empty_timeline() -> None:
    assert render_ascii(Timeline("nothing", 2, [])) == "rank 0\nrank 1"


# ---- trace --------------------------------------------------------------------------


def test_trace_is_chrome_json_with_one_x_event_per_action(tmp_path: Path) -> None:
    p, m = 4, 6
    timeline = simulate(sw.schedules.generate("1f1b", p, m)).timeline
    path = render_trace(timeline, tmp_path / "t.json")
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(1 for e in timeline.events if e.action.kind.is_compute) == 2 * p * m
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(p)}
    assert {e["pid"] for e in data["traceEvents"]} == {0}
    first = min((e for e in complete if e["tid"] == 3), key=lambda e: e["ts"])
    assert first["name"] == "F0" and first["cat"] == "F"
    assert first["ts"] == 3000.0 and first["dur"] == 1000.0  # 1 cost unit = 1 ms = 1000 us
    assert first["args"] == {"action": "3F0", "kind": "F", "stage": 3, "microbatch": 0}


def test_trace_of_measured_seconds_is_in_microseconds(tmp_path: Path) -> None:
    data = json.loads(render_trace(measured(), tmp_path / "m.json").read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(measured().events)
    b0 = next(e for e in complete if e["args"]["action"] == "1B0")
    assert b0["ts"] == pytest.approx(21500.0) and b0["dur"] == pytest.approx(21600.0)
    assert data["otherData"]["unit"] == "s"


def test_trace_rejects_an_unknown_unit(tmp_path: Path) -> None:
    timeline = Timeline("x", 1, [Event(0, parse_action("0F0"), 0.0, 1.0)], unit="fortnights")
    with pytest.raises(ValueError, match="unit 'fortnights'"):
        render_trace(timeline, tmp_path / "x.json")


# ---- PNG ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeline",
    [
        pytest.param(simulated("1f1b", 4, 8, comm_time=0.25, sync_time=0.5), id="1f1b"),
        pytest.param(
            simulate(sw.passes.lower(sw.schedules.generate("1f1b", 4, 8), split=True)).timeline, id="split-IW"
        ),
        pytest.param(interleaved_gpipe(4, 6, 2), id="two-stages-per-rank"),
        pytest.param(measured(), id="measured"),
        pytest.param(simulated("gpipe", 24, 48), id="many-ranks"),
    ],
)
def test_png_is_a_real_image(tmp_path: Path, timeline: Timeline) -> None:
    from PIL import Image

    path = render_png(timeline, tmp_path / "g.png", dpi=100)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        assert image.width == 1400 and image.height > 250  # 14 inches at 100 dpi
        colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colors is not None and len(colors) >= 8  # boxes of several kinds, text, axes: not a blank page


def test_png_title_can_be_given(tmp_path: Path) -> None:
    path = render_png(simulated("gpipe", 2, 2), tmp_path / "t.png", title="GPipe, p=2, m=2")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_png_of_an_empty_timeline(tmp_path: Path) -> None:
    path = render_png(Timeline("nothing", 1, []), tmp_path / "e.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


# ---- what the PNG's figure contains (issue 33's pictures) ---------------------------


def legend_texts(fig: Figure) -> list[str]:
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def box_texts(fig: Figure) -> list[tuple[float, float, str]]:
    """(x, y, text) of every label drawn inside the charts' axes."""
    return [(*text.get_position(), text.get_text()) for ax in fig.axes for text in ax.texts]


def test_the_legend_explains_the_virtual_stage_shading() -> None:
    shaded = legend_texts(timeline_figure(simulated("interleaved-1f1b", 4, 8)))
    assert "1st stage on a rank" in shaded and "2nd stage on a rank (lighter)" in shaded
    assert shaded.index("F forward") < shaded.index("1st stage on a rank")
    plain = legend_texts(timeline_figure(simulated("1f1b", 4, 8)))
    assert not [t for t in plain if "stage on a rank" in t]
    # a measured step of several stages per rank: waits in the legend beside the shades
    chunks = interleaved_gpipe(2, 2, 2)
    waits = [Event(1, parse_action("1RECV_F0"), 0.0, 1.0)]
    measured_chunks = Timeline("measured", 2, chunks.events + waits, source="measured", unit="s")
    texts = legend_texts(timeline_figure(measured_chunks))
    assert "send/recv wait" in texts and "2nd stage on a rank (lighter)" in texts


def test_forward_boxes_carry_their_stage_too() -> None:
    """Interleaved 1F1B: a forward is half a backward, and both name their stage under the micro-batch."""
    timeline = simulated("interleaved-1f1b", 4, 8)
    texts = box_texts(timeline_figure(timeline))
    for e in timeline.events:
        if e.action.kind in (Kind.F, Kind.B):
            x = (e.start + e.end) / 2
            here = {text for tx, ty, text in texts if abs(tx - x) < 1e-9 and abs(ty - e.rank) < 0.5}
            assert here == {str(e.action.microbatch), f"s{e.action.stage}"}, (str(e.action), here)


def test_no_weight_grad_entry_without_weight_grad_boxes() -> None:
    split = sw.build_schedule("zb-h1", 4, 8)
    free_w = simulate(split, CostModel.uniform(4, backward_weight=0.0)).timeline  # every W lasts 0
    assert "W weight grad" not in legend_texts(timeline_figure(free_w))
    assert "I input grad" in legend_texts(timeline_figure(free_w))
    assert "W weight grad" in legend_texts(timeline_figure(simulated("zb-h1", 4, 8)))


def test_many_microbatches_are_cut_into_readable_strips() -> None:
    """64 micro-batches over 4 ranks: strips of time under each other, every box wide enough for its label."""
    timeline = simulated("1f1b", 4, 64)
    fig = timeline_figure(timeline)
    assert len(fig.axes) > 1
    spans = [ax.get_xlim() for ax in fig.axes]
    assert spans[0][0] == 0 and spans[-1][1] >= timeline.makespan
    assert all(abs(a[1] - b[0]) < 3 / 110 * (a[1] - a[0]) + 1e-9 for a, b in zip(spans, spans[1:]))  # contiguous
    width_px = fig.axes[0].get_window_extent().width
    forward = min(e.duration for e in timeline.events if e.action.kind is Kind.F)
    assert forward * width_px / (spans[0][1] - spans[0][0]) >= 18  # the thinnest box holds a 2-digit label
    labels = {text for _, _, text in box_texts(fig)}
    assert {str(i) for i in range(64)} <= labels
    assert len(timeline_figure(timeline, strips=1).axes) == 1
    assert len(timeline_figure(simulated("1f1b", 4, 8)).axes) == 1  # a short step stays one chart


def test_a_stack_puts_measured_and_simulated_on_one_time_scale() -> None:
    measured_tl = measured()  # 0.099 s
    sim = simulated("1f1b", 2, 2, forward=0.01, backward_input=0.01, backward_weight=0.01)
    sim_s = Timeline(sim.name, sim.num_ranks, sim.events, unit="s")  # 0.09 s
    fig = stack_figure([measured_tl, sim_s], titles=["measured", "simulated"])
    (a0, a1), (b0, b1) = (ax.get_xlim() for ax in fig.axes)
    assert a1 - a0 == pytest.approx(b1 - b0)  # same seconds per inch in both panels
    assert a1 - a0 >= measured_tl.makespan
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "time (s)"]
    titles = [t.get_text() for t in fig.texts]
    assert any(t.startswith("measured  ·") for t in titles) and any(t.startswith("simulated  ·") for t in titles)
    with pytest.raises(ValueError, match="units 'cost' and 's'"):
        stack_figure([measured_tl, sim])  # seconds over cost units would mislead
    own = stack_figure([measured_tl, sim], share_x=False)
    assert [ax.get_xlabel() for ax in own.axes] == ["time (s)", "time (cost units)"]


def test_a_grid_of_methods_stays_readable() -> None:
    """Nine schedules, one panel each, full width: rows and labels as large as a single chart's."""
    names = ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "looped-bfs", "zb-v", "dualpipe-v", "naive"]
    timelines = [simulated(name, 4, 8) for name in names]
    fig = stack_figure(timelines, share_x=False, dpi=80)
    assert len(fig.axes) == len(names)
    for ax in fig.axes:
        box = ax.get_position()
        assert box.width * fig.get_figwidth() >= 12  # inches
        assert box.height * fig.get_figheight() >= 4 * 0.4
        assert all(text.get_fontsize() >= 6 for text in ax.texts)
    assert sum(1 for t in fig.texts if "  ·  4 ranks" in t.get_text()) == len(names)


def test_render_stack_writes_a_png(tmp_path: Path) -> None:
    path = render_stack([simulated("gpipe", 2, 2), simulated("1f1b", 2, 2)], tmp_path / "s.png", title="two")
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="2 titles for 1 timelines"):
        render_stack([simulated("gpipe", 2, 2)], tmp_path / "x.png", titles=["a", "b"])
