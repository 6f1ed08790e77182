"""``ops.timeline`` (the picture's data from a job's events, table-tested) and ``ops.timeline_plot``
(the PNG it draws: its size, and the generation lines counted in its pixels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.errors import ConfigError
from elasticd.ops.timeline import Generation, Mark, NodeFault, Recovery, Save, build_timeline
from elasticd.wire.ops import EventRecord

T0 = 1_700_000_000.0


def ev(t: float, kind: str, source: str = "n0.0.1", **detail: object) -> EventRecord:
    return EventRecord(time=T0 + t, kind=kind, source=source, detail=detail)


def gen(t: float, number: int, world: int, reason: str, committed: int = -1) -> EventRecord:
    return ev(t, "generation_published", generation=number, world_size=world, reason=reason, committed_step=committed)


HISTORY = [
    gen(0.0, 1, 3, "start"),
    ev(10.0, "progress", step=100),
    ev(12.0, "worker_exited", source="agent.node-1.77", how="was killed by SIGKILL", local_rank=0),
    gen(12.125, 2, 2, "aborted", committed=119),
    ev(12.375, "recovered", cause="PeerLost", duration_s=0.25, step=120),
    ev(15.0, "checkpoint_saved", step=150, duration_s=0.05),
    gen(16.0, 3, 3, "join", committed=190),
    ev(20.0, "progress", step=240),
    ev(21.0, "mystery_kind", whatever=1),  # unknown kinds are skipped
    ev(22.0, "recovered", cause="x", duration_s="bad", step=250),  # a field of the wrong type too
]


def test_the_series_from_a_history() -> None:
    tl = build_timeline("job", reversed(HISTORY))  # any order
    assert tl.start == T0 and tl.end_s == 22.0
    assert tl.generations == (
        Generation(0.0, 1, 3, "start"),
        Generation(12.125, 2, 2, "aborted"),
        Generation(16.0, 3, 3, "join"),
    )
    assert tl.steps == ((10.0, 100), (12.125, 119), (12.375, 120), (15.0, 150), (16.0, 190), (20.0, 240))
    assert tl.throughput[0] == (10.0, 12.125, pytest.approx(19 / 2.125))
    assert tl.faults == (
        Mark(12.0, "worker_exited", "node-1: worker killed by SIGKILL"),
        Mark(12.125, "generation_aborted", "gen 2 aborted"),
    )
    assert tl.recoveries == (Recovery(12.375, 0.25, "PeerLost", 120),)
    assert tl.saves == (Save(15.0, 150, 0.05),)
    assert tl.lost_s == pytest.approx(0.25)


@pytest.mark.parametrize(
    "events, steps",
    [
        ([], ()),
        # a generation's committed step arrives after a later progress point: steps only go up
        (
            [ev(0, "progress", step=50), gen(1, 2, 2, "member_lost", committed=40), ev(2, "progress", step=60)],
            ((0.0, 50), (2.0, 60)),
        ),
        ([gen(0, 1, 2, "start", committed=-1)], ()),  # no step yet
        ([ev(0, "progress", step=True)], ()),  # a bool is no step
    ],
)
def test_step_points_only_go_up(events, steps) -> None:
    assert build_timeline("j", events).steps == steps


@pytest.mark.parametrize(
    "kind, detail, label",
    [
        ("worker_stopped", {}, "node-1: worker stopped"),
        ("restarts_exhausted", {}, "node-1: restarts exhausted"),
        ("node_draining", {"cause": "SIGTERM"}, "node-1: draining (SIGTERM)"),
        (
            "node_draining",
            {"cause": "elasticctl drain by root@vm (elasticctl pid 9)"},
            "node-1: draining (elasticctl drain)",
        ),
        ("worker_exited", {"exit_kind": "succeeded", "code": 0, "how": "exited with code 0"}, None),  # finished
        (
            "worker_exited",
            {"exit_kind": "failed", "code": 3, "how": "exited with code 3"},
            "node-1: worker exited with code 3",
        ),
        ("node_drained", {}, None),  # the end of a drain is no fault
        ("worker_restarted", {}, None),
    ],
)
def test_agent_events_that_are_faults(kind, detail, label) -> None:
    tl = build_timeline("j", [ev(0, kind, source="agent.node-1.9", **detail)])
    assert [f.label for f in tl.faults] == ([label] if label else [])


def test_png_size_and_one_violet_line_per_generation(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from elasticd.ops.timeline_plot import DPI, GENERATION_RGB, SIZE_IN, render

    out = tmp_path / "t.png"
    columns = render(build_timeline("job", HISTORY), str(out))
    assert columns == 3
    img = plt.imread(out)
    assert img.shape[:2] == (SIZE_IN[1] * DPI, SIZE_IN[0] * DPI)
    assert count_lines(img, GENERATION_RGB) == 3


def count_lines(img, rgb: tuple[int, int, int]) -> int:  # type: ignore[no-untyped-def]
    """Runs of adjacent pixel columns holding the exact colour ``rgb``."""
    import numpy as np

    px = (img[:, :, :3] * 255).round().astype(int)
    hit = np.all(px == np.array(rgb), axis=2).any(axis=0)
    return int(np.sum(hit[1:] & ~hit[:-1]) + hit[0])


def test_svg_and_html_and_bad_suffix(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from elasticd.ops.timeline_plot import render

    tl = build_timeline("job", HISTORY)
    render(tl, str(tmp_path / "t.svg"))
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    render(tl, str(tmp_path / "t.html"))
    page = (tmp_path / "t.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<script" not in page
    with pytest.raises(ConfigError, match=r"\.png, \.svg or \.html"):
        render(tl, str(tmp_path / "t.jpg"))


NODE_HISTORY = [
    ev(1.0, "worker_exited", source="agent.b.7", node="b", exit_kind="signal", how="was killed by SIGKILL"),
    ev(2.0, "worker_exited", source="agent.b.7", node="b", exit_kind="succeeded", code=0),  # finished
    ev(3.0, "worker_hung", source="agent.a.5", node="a", local_rank=0),
    ev(4.0, "health_check_failed", source="agent.c.9", node="c", output="disk full"),
    ev(5.0, "straggler_detected", source="agent.a.5", node="a", score=2.1),
    ev(6.0, "node_cordoned", source="agent.b.7", node="b", reason="6 crashes"),
    ev(7.0, "worker_hung", source="agent.x.1"),  # no node named: not placed on a row
    ev(8.0, "job_failed", source="agent.a.5", node="a", step=12, exception="ValueError: x"),
]


def test_node_faults_per_node() -> None:
    tl = build_timeline("j", NODE_HISTORY)
    assert tl.node_faults == (
        NodeFault(0.0, "b", "crash"),  # seconds since the first event
        NodeFault(2.0, "a", "hang"),
        NodeFault(3.0, "c", "health"),
        NodeFault(4.0, "a", "straggler"),
        NodeFault(5.0, "b", "cordon"),
    )
    assert tl.nodes == ("a", "b", "c")
    assert "job failed: bug at step 12" in [f.label for f in tl.faults]


def test_the_node_fault_panel_has_a_row_per_node_and_a_mark_per_fault() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from elasticd.ops.timeline_plot import NODE_FAULT_STYLE, _draw_node_faults

    fig, ax = plt.subplots()
    try:
        _draw_node_faults(build_timeline("j", NODE_HISTORY), ax)
        assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
        marks = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
        assert set(marks) == set(NODE_FAULT_STYLE)
        assert marks["crash"] == [[0.0, 1.0]] and marks["cordon"] == [[5.0, 1.0]]  # node b's row
        assert marks["hang"] == [[2.0, 0.0]] and marks["straggler"] == [[4.0, 0.0]]  # node a's
        assert marks["health"] == [[3.0, 2.0]]
        ax.clear()
        _draw_node_faults(build_timeline("j", HISTORY), ax)  # no node faults
        assert not ax.collections and [t.get_text() for t in ax.texts] == ["no node faults"]
    finally:
        plt.close(fig)
