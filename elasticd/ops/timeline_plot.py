"""Draws a ``Timeline`` (``ops.timeline``) into a PNG, SVG or HTML file with matplotlib, the
optional dependency ``elasticd[plot]`` (``render``).

Four panels on one time axis (seconds since the job's first event): committed steps, with each
checkpoint save marked; world size, with each generation's start as a thin violet line, each fault
as a red mark labelled with what happened, and each recovery as an orange band as long as it took,
labelled with its cause and duration; node faults, a row per node with a mark per crash, hang,
failed health check, straggler episode and cordon; throughput in steps per second. The title says how many
generations, faults and recoveries there were, and the training time the recoveries took. HTML is
the SVG inside a page of its own (no script, no external file).

The generation lines are drawn without antialiasing in one colour used for nothing else
(``GENERATION_RGB``), so a test can count them in the PNG; ``render`` returns how many distinct
pixel columns they fall on.
"""

from __future__ import annotations

import html
import io
from pathlib import Path

from elasticd.errors import ConfigError
from elasticd.ops.timeline import Timeline

GENERATION_RGB = (0x80, 0x00, 0xFF)  # the generation lines' colour: nothing else is drawn in it
SIZE_IN = (14.0, 8.0)
DPI = 100
LABELLED_MAX = 40  # faults and recoveries get a text label when there are at most this many
FORMATS = ("png", "svg", "html")
# the node-fault panel's mark for each kind (wire.nodefaults' kinds, and a cordon): (marker, colour)
NODE_FAULT_STYLE = {
    "crash": ("x", "#d62728"),
    "hang": ("s", "#8c564b"),
    "health": ("D", "#e377c2"),
    "straggler": (">", "#ff7f0e"),
    "cordon": ("|", "#000000"),
}
NODE_ROWS_NAMED = 24  # the node-fault panel names its rows up to this many nodes


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("elasticctl timeline needs matplotlib: pip install 'elasticd[plot]'") from exc
    return plt


def _grouped(tl: Timeline, within_s: float) -> list[tuple[float, list[str]]]:
    """Faults less than ``within_s`` after the first of a group drawn as one mark, their labels
    joined (a killed worker and the generation published without it)."""
    groups: list[tuple[float, list[str]]] = []
    for f in tl.faults:
        if groups and f.t - groups[-1][0] < within_s:
            if f.label not in groups[-1][1]:
                groups[-1][1].append(f.label)
        else:
            groups.append((f.t, [f.label]))
    return groups


def output_format(path: str) -> str:
    """The format a path's suffix names (``png``, ``svg`` or ``html``).

    Raises:
        ConfigError: another suffix.
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise ConfigError(f"--out: the file must end in .png, .svg or .html, got {path!r}")
    return suffix


def render(tl: Timeline, path: str) -> int:
    """Draw ``tl`` into ``path`` (its suffix picks the format).

    Returns:
        The distinct pixel columns of the generation lines (PNG and SVG alike).

    Raises:
        ConfigError: matplotlib is not installed, or the suffix is not .png, .svg or .html.
        OSError: the file cannot be written.
    """
    fmt = output_format(path)
    plt = _pyplot()
    fig, (ax_step, ax_world, ax_nodes, ax_rate) = plt.subplots(
        4, 1, sharex=True, figsize=SIZE_IN, dpi=DPI, gridspec_kw={"height_ratios": [3, 2, 1.5, 2]}
    )
    try:
        end = max(tl.end_s, 1.0)
        _draw_steps(tl, ax_step)
        _draw_world(tl, ax_world, end)
        _draw_node_faults(tl, ax_nodes)
        _draw_rate(tl, ax_rate, end)
        fig.suptitle(
            f"job {tl.job_id}: {len(tl.generations)} generations, {len(tl.faults)} faults, "
            f"{len(tl.recoveries)} recoveries ({tl.lost_s:.2f} s from fault to next commit)",
            fontsize=11,
        )
        fig.subplots_adjust(left=0.08, right=0.99, top=0.94, bottom=0.07, hspace=0.12)
        fig.canvas.draw()
        columns = len({round(float(ax_world.transData.transform((g.t, 0))[0])) for g in tl.generations})
        _save(tl, fig, path, fmt)
        return columns
    finally:
        plt.close(fig)


def _draw_steps(tl: Timeline, ax) -> None:  # type: ignore[no-untyped-def]
    """Committed steps, and each checkpoint save."""
    if tl.steps:
        ax.plot([t for t, _ in tl.steps], [s for _, s in tl.steps], color="#1f77b4", lw=1.5, label="committed step")
    if tl.saves:
        ax.scatter(
            [s.t for s in tl.saves],
            [s.step for s in tl.saves],
            marker="v",
            color="#2ca02c",
            zorder=3,
            label="checkpoint saved",
        )
    ax.set_ylabel("committed step")
    ax.legend(loc="upper left", fontsize=8, frameon=False)


def _draw_world(tl: Timeline, ax, end: float) -> None:  # type: ignore[no-untyped-def]
    """World size, with each generation, fault and recovery."""
    color = "#%02x%02x%02x" % GENERATION_RGB
    if tl.generations:
        xs = [g.t for g in tl.generations] + [end]
        ys = [g.world_size for g in tl.generations] + [tl.generations[-1].world_size]
        ax.step(xs, ys, where="post", color="black", lw=1.5)
        top = max(ys) + 1
    else:
        top = 2
    ax.set_ylim(0, top + 3.2)  # room for the fault labels above the line
    for g in tl.generations:
        ax.axvline(g.t, color=color, lw=1, antialiased=False, zorder=5)  # above the bands
    labelled = len(tl.faults) + len(tl.recoveries) <= LABELLED_MAX
    for r in tl.recoveries:
        ax.axvspan(r.t - r.duration_s, r.t, color="#ff7f0e", alpha=0.35, lw=0)
        if labelled:
            text = f"{r.cause} {r.duration_s:.2f}s"
            ax.annotate(
                text, (r.t, 0.3), fontsize=7, rotation=90, color="#b35900", va="bottom", ha="left", clip_on=True
            )
    for i, (t, labels) in enumerate(_grouped(tl, end / 100)):
        ax.plot([t], [top + 0.3], marker="x", color="#d62728", ms=7, mew=2)
        if labelled:  # staggered on three levels, so that neighbours do not overlap
            at = (t, top + 0.8 + (i % 3) * 0.8)
            ax.annotate("; ".join(labels), at, fontsize=7, color="#d62728", ha="left", va="bottom", clip_on=True)
    ax.set_ylabel("world size")
    legend = "violet: new generation   red x: fault   orange: recovery"
    ax.text(0.995, 0.02, legend, transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="#555555")


def _draw_node_faults(tl: Timeline, ax) -> None:  # type: ignore[no-untyped-def]
    """One row per node that had a fault: a mark per crash, hang, failed health check, straggler
    episode and cordon (``NODE_FAULT_STYLE``)."""
    nodes = tl.nodes
    row = {n: i for i, n in enumerate(nodes)}
    for kind, (marker, color) in NODE_FAULT_STYLE.items():
        points = [(f.t, row[f.node]) for f in tl.node_faults if f.kind == kind]
        if points:
            ax.scatter([t for t, _ in points], [y for _, y in points], marker=marker, color=color, s=30, label=kind)
    ax.set_ylim(-0.8, max(len(nodes), 1) - 0.2)
    ax.set_yticks(range(len(nodes)), list(nodes) if len(nodes) <= NODE_ROWS_NAMED else [""] * len(nodes))
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylabel("node faults")
    if nodes:
        ax.legend(loc="upper left", fontsize=7, frameon=False, ncol=len(NODE_FAULT_STYLE))
    else:
        ax.text(0.5, 0.5, "no node faults", transform=ax.transAxes, ha="center", va="center", fontsize=8)


def _draw_rate(tl: Timeline, ax, end: float) -> None:  # type: ignore[no-untyped-def]
    """Throughput between consecutive step points."""
    for t0, t1, rate in tl.throughput:
        ax.plot([t0, t1], [rate, rate], color="#9467bd", lw=1.5)
    ax.set_ylabel("steps / s")
    ax.set_xlabel("seconds since the job's first event")
    ax.set_ylim(bottom=0)
    ax.set_xlim(-end / 100, end * 1.01)  # a line at 0 is not hidden by the axis


def _save(tl: Timeline, fig, path: str, fmt: str) -> None:  # type: ignore[no-untyped-def]
    meta = {
        "Title": f"elasticd timeline of job {tl.job_id}",
        "Description": f"generations={len(tl.generations)} faults={len(tl.faults)}",
    }
    if fmt == "html":
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Title": meta["Title"], "Description": meta["Description"]})
        page = (
            f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(meta["Title"])}'
            f"</title></head><body>{buf.getvalue()}</body></html>\n"
        )
        Path(path).write_text(page)
    else:
        fig.savefig(path, format=fmt, metadata=meta)
