"""Text and JSON renderings of the read model: ``elasticctl status`` and ``elasticctl events``. Pure.

Owns the JSON shapes (``to_dict``, ``events_to_dict``: every key always present, ``null`` when
unknown) and the aligned tables (``render_table``, ``render_events_table``). Every field that comes
from etcd is escaped before it reaches a terminal. Never reads etcd or a clock, and never decides
anything about the job (``ops.status``, ``ops.health``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence

from elasticd.wire.nodefaults import describe as describe_faults
from elasticd.ops.status import (
    RECOVERIES_SHOWN,
    JobEvents,
    JobStatus,
    MemberStatus,
    NodeStatus,
)


def to_dict(status: JobStatus) -> dict[str, object]:
    """The JSON shape of a status: every key is always present (``null`` when unknown)."""
    g = status.generation
    return {
        "job": status.job_id,
        "prefix": status.prefix,
        "health": str(status.health),
        "reason": status.reason,
        "exit_code": status.exit_code,
        "min_workers": status.min_workers,
        "max_workers": status.max_workers,
        "generation": None
        if g is None
        else {
            "number": g.number,
            "world_size": g.world_size,
            "members": list(g.members),
            "reason": g.reason,
            "committed_step": g.committed_step,
        },
        "members": [
            {
                "member_id": m.member_id,
                "node": m.node,
                "local_rank": m.local_rank,
                "pid": m.pid,
                "host": m.host,
                "rank": m.rank,
                "state": str(m.state),
                "committed_step": m.committed_step,
                "step_time_s": _round(m.step_time_s, 6),
                "compute_s": _round(m.compute_s, 6),
                "straggler_score": _round(m.straggler_score, 3),
                "recoveries": m.recoveries,
                "heartbeat_age_s": _round(m.heartbeat_age_s, 3),
                "restarts": m.restarts,
                "rss_bytes": m.rss_bytes,
                "cpu_percent": m.cpu_percent,
            }
            for m in status.members
        ],
        "nodes": [
            {
                "node": n.node,
                "host": n.host,
                "agent_pid": n.agent_pid,
                "state": n.state,
                "workers_running": n.workers_running,
                "workers": n.workers,
                "restarts": n.restarts,
                "heartbeat_age_s": _round(n.heartbeat_age_s, 3),
                "drain_requested": n.drain_requested,
                "spares": n.spares,
                "standby": n.standby,
                "health": n.health,
                "faults_last_hour": dict(n.faults),
                "cordoned": n.cordoned,
            }
            for n in status.nodes
        ],
        "recoveries": [
            {"time": r.time, "generation": r.generation, "cause": r.cause, "duration_s": r.duration_s}
            for r in status.recoveries
        ],
        "drains": list(status.drains),
        "missing": list(status.missing),
        "finished": None
        if status.finished is None
        else {
            "generation": status.finished.generation,
            "step": status.finished.step,
        },
        "last_abort": None
        if status.last_abort is None
        else {
            "generation": status.last_abort.generation,
            "member_id": status.last_abort.member_id,
            "reason": status.last_abort.reason,
        },
        "malformed": list(status.malformed),
        "restart": None
        if status.restart is None
        else {
            "round": status.restart.round,
            "world_size": status.restart.world_size,
            "nodes": list(status.restart.nodes),
            "nproc_per_node": status.restart.nproc_per_node,
            "master": status.restart.master,
            "restart_count": status.restart.restart_count,
            "reason": status.restart.reason,
            "agents": list(status.restart.agents),
            "failed_round": status.restart.failed_round,
            "finished_round": status.restart.finished_round,
        },
        "checkpoint": None
        if status.checkpoint is None
        else {
            "step": status.checkpoint.step,
            "path": status.checkpoint.path,
            "node": status.checkpoint.node,
            "generation": status.checkpoint.generation,
            "bytes": status.checkpoint.bytes,
            "age_s": _round(status.checkpoint_age_s, 3),
        },
        **_failures_dict(status),
        "stall_after_s": status.stall_after_s,
        "last_activity_age_s": _round(status.last_activity_age_s, 3),
    }


def _failures_dict(status: JobStatus) -> dict[str, object]:
    """``save_failed`` (the last failed checkpoint save), ``bug`` (the bug that stopped the job, or
    None) and ``failures`` (every record) of ``to_dict``."""
    b = status.bug
    return {
        "save_failed": None
        if status.save_failed is None
        else {
            "time": status.save_failed.time,
            "step": status.save_failed.step,
            "generation": status.save_failed.generation,
            "node": status.save_failed.node,
            "directory": status.save_failed.directory,
            "errno": status.save_failed.errno,
            "error": status.save_failed.error,
            "failing": status.save_failing,
        },
        "bug": None
        if b is None
        else {
            "step": b.step,
            "exception": f"{b.exc_type}: {b.message}",
            "members": list(b.members),
            "nodes": list(b.nodes),
            "detail": b.detail,
        },
        "failures": [
            {
                "member": f.member,
                "node": f.node,
                "step": f.step,
                "generation": f.generation,
                "exception": f"{f.exc_type}: {f.message}",
                "time": f.time,
            }
            for f in status.failures
        ],
    }


def _failure_lines(status: JobStatus) -> list[tuple[str, str]]:
    """The report's ``save error`` line (a failed checkpoint save), a ``health`` line per node whose
    check fails, and its ``stopped by`` line (a bug) or ``last failure`` (records, no bug yet)."""
    lines = [("save error", _save_failed_line(status))] if status.save_failed is not None else []
    lines += [
        ("health", _clean(f"node {n.node}: {n.health}")) for n in status.nodes if n.health and n.health != "passing"
    ]
    lines += [("cordoned", _clean(f"node {node}: {why}")) for node, why in sorted(status.cordoned.items())]
    if status.bug is not None:
        b = status.bug
        return [
            *lines,
            ("stopped by", _clean(f"step {b.step}: {b.exc_type}: {b.message} (workers {', '.join(b.members)})")),
        ]
    if status.failures:
        f = status.failures[-1]
        n = len(status.failures)
        return [
            *lines,
            ("last failure", _clean(f"{f.member} at step {f.step}: {f.exc_type}: {f.message} ({n} recorded)")),
        ]
    return lines


def render_json(status: JobStatus) -> str:
    """One JSON object on one line (so ``--watch --json`` prints JSON lines)."""
    return json.dumps(to_dict(status))


_COLUMNS = (
    "MEMBER",
    "NODE",
    "LOCAL",
    "PID",
    "HOST",
    "RANK",
    "STATE",
    "STEP",
    "STEP_TIME",
    "COMPUTE",
    "SCORE",
    "RECOVERIES",
    "HEARTBEAT",
    "RESTARTS",
    "RSS",
    "CPU",
)
_NODE_COLUMNS = (
    "NODE",
    "HOST",
    "AGENT_PID",
    "AGENT_STATE",
    "WORKERS",
    "SPARES",
    "RESTARTS",
    "FAULTS_1H",
    "HEARTBEAT",
    "DRAIN",
)


def render_table(status: JobStatus) -> str:
    """A human-readable report: a summary, one aligned row per live member, then problems."""
    g = status.generation
    bounds = f"min_workers {_opt(status.min_workers)}, max_workers {_opt(status.max_workers)}"
    if status.min_workers is None or status.max_workers is None:
        bounds += " (not stored in etcd: pass --min-workers/--max-workers)"
    lines = [
        ("job", f"{_clean(status.job_id)} ({_clean(status.prefix)})"),
        ("health", f"{status.health.upper()}: {_clean(status.reason)}"),
        (
            "generation",
            "none"
            if g is None
            else f"{g.number}, world size {g.world_size}, published for {_clean(g.reason)} at step {g.committed_step}",
        ),
        ("bounds", bounds),
        (
            "finished",
            "no"
            if status.finished is None
            else f"at step {status.finished.step} (generation {status.finished.generation})",
        ),
        (
            "last abort",
            "none"
            if status.last_abort is None
            else f"generation {status.last_abort.generation} by {_clean(status.last_abort.member_id)}: "
            f"{_clean(status.last_abort.reason)}",
        ),
        ("checkpoint", _checkpoint_line(status)),
    ]
    lines += _failure_lines(status)
    r = status.restart
    if r is not None:
        lines.append(
            (
                "restart",
                f"mode restart: round {r.round} ({_clean(r.reason)}), world size {r.world_size} = "
                f"{len(r.nodes)} node(s) x {r.nproc_per_node} [{_clean(', '.join(r.nodes))}], master "
                f"{_clean(r.master)}, {r.restart_count} restart(s); agents alive: "
                f"{_clean(', '.join(r.agents)) or 'none'}",
            )
        )
    out = [f"{k:<11} {v}" for k, v in lines]
    out.append("")
    if status.members:
        out += _aligned([_COLUMNS] + [_row(m) for m in status.members])
    else:
        out.append("no live members")
    out.append("")
    if status.nodes:
        out += _aligned([_NODE_COLUMNS] + [_node_row(n) for n in status.nodes])
    else:
        out.append("no node agents (workers started without elasticd, or none running)")
    out.append("")
    if status.recoveries:
        out.append(f"last recoveries (newest last, at most {RECOVERIES_SHOWN}):")
        out += [
            f"  {_utc(r.time)}  generation {_opt(r.generation)}  {_clean(r.cause)}  "
            f"{'-' if r.duration_s is None else f'{r.duration_s:.3f}s'}"
            for r in status.recoveries
        ]
    else:
        out.append("last recoveries: none recorded")
    orphan = [d for d in status.drains if d not in {n.node for n in status.nodes}]
    if orphan:
        out.append("")
        out.append("drain requested for nodes without an agent record: " + ", ".join(map(_clean, orphan)))
    if status.missing:
        out.append("")
        out.append("missing (in the generation, lease gone): " + ", ".join(map(_clean, status.missing)))
    if status.malformed:
        out.append("")
        out.append(f"malformed records ({len(status.malformed)}, ignored):")
        out += [f"  {_clean(m)}" for m in status.malformed]
    return "\n".join(out) + "\n"


def _aligned(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _node_row(n: NodeStatus) -> tuple[str, ...]:
    return (
        _clean(n.node),
        _clean(n.host),
        str(n.agent_pid),
        _clean(n.state),
        f"{n.workers_running}/{n.workers}",
        f"{n.spares} (standby node)" if n.standby else str(n.spares),
        str(n.restarts),
        describe_faults(n.faults),
        f"{n.heartbeat_age_s:.1f}s ago",
        "requested" if n.drain_requested else "-",
    )


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}MiB"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if math.isfinite(t) and abs(t) < 1e11 else "?"


def _checkpoint_line(status: JobStatus) -> str:
    ck = status.checkpoint
    if ck is None:
        return "none recorded"
    age = "" if status.checkpoint_age_s is None else f", {status.checkpoint_age_s:.1f}s ago"
    return f"step {ck.step} on {_clean(ck.node)}: {_clean(ck.path)} ({ck.bytes} bytes{age})"


def _save_failed_line(status: JobStatus) -> str:
    f = status.save_failed
    assert f is not None
    when = "the latest save" if status.save_failing else "a good checkpoint was saved since"
    return f"{when}: step {f.step} at {_utc(f.time)} on {_clean(f.node)} into {_clean(f.directory)}: {_clean(f.error)}"


def _row(m: MemberStatus) -> tuple[str, ...]:
    return (
        _clean(m.member_id),
        _clean(m.node),
        str(m.local_rank),
        str(m.pid),
        _clean(m.host),
        _opt(m.rank),
        str(m.state),
        _opt(m.committed_step),
        "-" if m.step_time_s is None else f"{m.step_time_s:.3f}s",
        "-" if m.compute_s is None else f"{m.compute_s:.3f}s",
        "-" if m.straggler_score is None else f"{m.straggler_score:.2f}",
        _opt(m.recoveries),
        "-" if m.heartbeat_age_s is None else f"{m.heartbeat_age_s:.1f}s ago",
        _opt(m.restarts),
        _mib(m.rss_bytes),
        "-" if m.cpu_percent is None else f"{m.cpu_percent:.0f}%",
    )


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _clean(text: str) -> str:
    """Escape control characters: record fields come from etcd and must not drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def events_to_dict(ev: JobEvents) -> dict[str, object]:
    """The JSON shape of ``elasticctl events --json``: every key always present."""
    return {
        "job": ev.job_id,
        "prefix": ev.prefix,
        "total": ev.total,
        "events": [
            {"key": key, "time": e.time, "kind": e.kind, "source": e.source, "detail": dict(e.detail)}
            for key, e in ev.events
        ],
        "malformed": list(ev.malformed),
    }


def render_events_json(ev: JobEvents) -> str:
    return json.dumps(events_to_dict(ev), default=str)


def render_events_table(ev: JobEvents) -> str:
    """One line per event, oldest first: UTC time, kind, writer, details; then malformed keys."""
    out = [f"job {_clean(ev.job_id)} ({_clean(ev.prefix)}): {len(ev.events)} of {ev.total} event(s), newest last"]
    if ev.events:
        rows = [("TIME", "KIND", "SOURCE", "DETAIL")]
        for _, e in ev.events:
            ms = int(round((e.time % 1) * 1000)) % 1000 if math.isfinite(e.time) else 0
            rows.append((f"{_utc(e.time)[:-1]}.{ms:03d}Z", _clean(e.kind), _clean(e.source), _detail(e.detail)))
        out += _aligned(rows)
    if ev.malformed:
        out.append("")
        out.append(f"malformed events ({len(ev.malformed)}, ignored):")
        out += [f"  {_clean(m)}" for m in ev.malformed]
    return "\n".join(out) + "\n"


def _detail(detail: Mapping[str, object]) -> str:
    parts = []
    for k in sorted(detail):
        v = detail[k]
        plain = isinstance(v, str) and v and not any(c.isspace() or c in '"=' for c in v)
        text = v if plain and isinstance(v, str) else json.dumps(v, default=str, separators=(",", ":"))
        parts.append(f"{k}={text}")
    return _clean(" ".join(parts))
