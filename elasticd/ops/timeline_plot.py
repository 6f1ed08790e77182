"""Draws a ``Timeline`` (``ops.timeline``) into a PNG, SVG or HTML file with matplotlib, the
optional dependency ``elasticd[plot]`` (``render``).

Three panels on one time axis (seconds since the job's first event): committed steps, with each
checkpoint save marked; world size, with each generation's start as a thin violet line, each fault
as a red mark labelled with what happened, and each recovery as an orange band as long as it took,
labelled with its cause and duration; throughput in steps per second. The title says how many
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
    fig, (ax_step, ax_world, ax_rate) = plt.subplots(
        3, 1, sharex=True, figsize=SIZE_IN, dpi=DPI, gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    try:
        return _draw(tl, path, fmt, fig, ax_step, ax_world, ax_rate)
    finally:
        plt.close(fig)


def _draw(tl: Timeline, path: str, fmt: str, fig, ax_step, ax_world, ax_rate) -> int:  # type: ignore[no-untyped-def]
    color = "#%02x%02x%02x" % GENERATION_RGB
    end = max(tl.end_s, 1.0)
    # committed steps and saves
    if tl.steps:
        ax_step.plot(
            [t for t, _ in tl.steps], [s for _, s in tl.steps], color="#1f77b4", lw=1.5, label="committed step"
        )
    if tl.saves:
        ax_step.scatter(
            [s.t for s in tl.saves],
            [s.step for s in tl.saves],
            marker="v",
            color="#2ca02c",
            zorder=3,
            label="checkpoint saved",
        )
    ax_step.set_ylabel("committed step")
    ax_step.legend(loc="upper left", fontsize=8, frameon=False)
    # world size, generations, faults, recoveries
    if tl.generations:
        xs = [g.t for g in tl.generations] + [end]
        ys = [g.world_size for g in tl.generations] + [tl.generations[-1].world_size]
        ax_world.step(xs, ys, where="post", color="black", lw=1.5)
        top = max(ys) + 1
    else:
        top = 2
    ax_world.set_ylim(0, top + 3.2)  # room for the fault labels above the line
    for g in tl.generations:
        ax_world.axvline(g.t, color=color, lw=1, antialiased=False, zorder=5)  # above the bands
    labelled = len(tl.faults) + len(tl.recoveries) <= LABELLED_MAX
    for r in tl.recoveries:
        ax_world.axvspan(r.t - r.duration_s, r.t, color="#ff7f0e", alpha=0.35, lw=0)
        if labelled:
            ax_world.annotate(
                f"{r.cause} {r.duration_s:.2f}s",
                (r.t, 0.3),
                fontsize=7,
                rotation=90,
                color="#b35900",
                va="bottom",
                ha="left",
                clip_on=True,
            )
    for i, (t, labels) in enumerate(_grouped(tl, end / 100)):
        ax_world.plot([t], [top + 0.3], marker="x", color="#d62728", ms=7, mew=2)
        if labelled:  # staggered on three levels, so that neighbours do not overlap
            ax_world.annotate(
                "; ".join(labels),
                (t, top + 0.8 + (i % 3) * 0.8),
                fontsize=7,
                color="#d62728",
                ha="left",
                va="bottom",
                clip_on=True,
            )
    ax_world.set_ylabel("world size")
    ax_world.text(
        0.995,
        0.02,
        "violet: new generation   red x: fault   orange: recovery",
        transform=ax_world.transAxes,
        ha="right",
        va="bottom",
        fontsize=7,
        color="#555555",
    )
    # throughput
    for t0, t1, rate in tl.throughput:
        ax_rate.plot([t0, t1], [rate, rate], color="#9467bd", lw=1.5)
    ax_rate.set_ylabel("steps / s")
    ax_rate.set_xlabel("seconds since the job's first event")
    ax_rate.set_ylim(bottom=0)
    ax_rate.set_xlim(-end / 100, end * 1.01)  # a line at 0 is not hidden by the axis
    fig.suptitle(
        f"job {tl.job_id}: {len(tl.generations)} generations, {len(tl.faults)} faults, "
        f"{len(tl.recoveries)} recoveries ({tl.lost_s:.2f} s from fault to next commit)",
        fontsize=11,
    )
    fig.subplots_adjust(left=0.06, right=0.99, top=0.94, bottom=0.07, hspace=0.12)
    fig.canvas.draw()
    columns = len({round(float(ax_world.transData.transform((g.t, 0))[0])) for g in tl.generations})
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
    return columns
