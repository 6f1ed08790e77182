"""A chaos run's report: the human table and the ``--json`` object (pure).

Owns ``Report`` (the settings, the evidence and the verdict of one run) and its two renderings:
``render_table`` (faults injected per kind, the invariants, the stalls and the figures) and
``report_to_dict`` (every key always present). It decides nothing: the verdict is ``judge``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticd.chaos.ettr import QUIET_AFTER_S
from elasticd.chaos.evidence import Evidence
from elasticd.chaos.judge import Verdict
from elasticd.chaos.schedule import Settings


@dataclass(frozen=True)
class Report:
    settings: Settings
    evidence: Evidence
    verdict: Verdict
    started_t: float  # wall clock of the run's start (times are printed relative to it)
    workdir: str
    skipped: Mapping[str, str] = field(default_factory=dict)  # kinds not possible here -> why


def injected_counts(report: Report) -> dict[str, int]:
    counts = {k.value: 0 for k in report.settings.kinds}
    for f in report.evidence.faults:
        if f.kind in counts:
            counts[f.kind] += 1
    return counts


def render_table(report: Report) -> str:
    """The human summary: faults injected per kind, then the invariants and the figures."""
    s, v, ev = report.settings, report.verdict, report.evidence
    rel = report.started_t
    lines = [
        f"== chaos: seed {s.seed}, {s.minutes:g} min of faults (mean interval {s.mean_interval_s:g} s), "
        f"{s.nodes} nodes (min {s.min_nodes}, max {s.max_nodes}), etcd {s.etcd_members} member(s), "
        f"lease TTL {ev.lease_ttl_s:g} s, hosts {'netns' if s.netns else 'loopback'} ==",
        "",
        f"{'FAULT':<22}{'INJECTED':<10}COST (training time lost until the next fault: total, mean"
        + (f"; against the {v.cost_baseline} step time)" if v.cost_baseline else ")"),
    ]
    for kind, n in injected_counts(report).items():
        cost = v.cost_by_kind.get(kind)
        lines.append(f"{kind:<22}{n:<10}" + (f"{cost[1]:6.1f} s  {cost[1] / cost[0]:5.2f} s" if cost else "-"))
    for kind, why in report.skipped.items():
        lines.append(f"{kind:<22}-  (skipped: {why})")
    lines += ["", f"{'INVARIANT':<30}{'RESULT':<8}DETAIL"]
    for i in v.invariants:
        lines.append(f"{i.name:<30}{'PASS' if i.ok else 'FAIL':<8}{i.detail}")
    lines.append("")
    if v.stalls:
        lines.append(f"stalls (no commit for > {ev.lease_ttl_s + 2:g} s; times from the start of the run)")
        lines.append(f"  {'START':>8} {'LENGTH':>7} {'EXCUSED':>8}  GENERATIONS  FAULTS JUST BEFORE")
        for st in v.stalls:
            gens = f"{st.generations[0]}->{st.generations[1] if st.generations[1] >= 0 else 'end'}"
            lines.append(
                f"  {st.start - rel:7.1f}s {st.length_s:6.1f}s {st.excused_s:7.1f}s  {gens:<12} "
                f"{', '.join(st.faults) or '-'}"
            )
    else:
        lines.append("stalls            none")
    if ev.etcd_down:
        lines.append(
            "etcd down         " + ", ".join(f"{w.start - rel:.1f}s+{w.end - w.start:.1f}s" for w in ev.etcd_down)
        )
    if ev.link_down:
        lines.append(
            "link down         "
            + ", ".join(f"{d.node} {d.start - rel:.1f}s+{d.end - d.start:.1f}s" for d in ev.link_down)
        )
    ettr_text = f"{v.ettr:.3f}" if v.ettr is not None else "-"
    quiet_text = f"{v.ettr_quiet:.3f}" if v.ettr_quiet is not None else "-"
    quiet_world = ", ".join(f"world {w}: {t * 1000:.1f} ms" for w, t in v.quiet_step_s_by_world.items()) or "too few"
    single_text = f"{v.ettr_single:.3f}" if v.ettr_single is not None else "-"
    step_text = f"{v.step_s * 1000:.1f} ms" if v.step_s is not None else "-"
    faulted = f"{ev.faulted.end - ev.faulted.start:.1f} s" if ev.faulted else "-"
    per_world = ", ".join(f"world {w}: {t * 1000:.1f} ms" for w, t in v.step_s_by_world.items()) or "-"
    at_world = ", ".join(f"{n} at world {w}" for w, n in v.faulted_steps_by_world.items()) or "no steps"
    unmeasured = "".join(f"; world {w}: no fault-free measurement, used world {u}'s" for w, u in v.substituted.items())
    lines += [
        f"fault-free step   {per_world} (warm-up, {s.warmup_s:g} s per world size)",
        f"ETTR              {ettr_text} ({at_world}, each x its world size's fault-free step time / {faulted} "
        f"faulted{unmeasured})",
        f"ETTR quiet steps  {quiet_text} (the same, each x the median step time of the faulted window's quiet "
        f"steps at its world size, {QUIET_AFTER_S:g} s after a fault: {quiet_world})",
        f"ETTR 1 baseline   {single_text} ({v.faulted_steps} steps x {step_text} fault-free at world {s.nodes} / "
        f"{faulted} faulted)",
        f"steps             {v.steps.last_step}/{ev.target_steps}",
        f"generations       {len(v.steps.generations)}",
        f"steps discarded   {sum(ev.discarded.values())} (applied by a member, never confirmed: "
        f"the others committed them; {'; '.join(f'{n} {r}' for r, n in ev.discarded.items()) or 'none'})",
        f"status samples    {len(ev.samples)}",
        f"result            {'PASS' if v.ok else 'FAIL'}",
        f"work dir          {report.workdir}",
    ]
    return "\n".join(lines) + "\n"


def report_to_dict(report: Report) -> dict[str, object]:
    """The ``--json`` object: every key always present."""
    s, v, ev = report.settings, report.verdict, report.evidence
    rel = report.started_t
    return {
        "ok": v.ok,
        "seed": s.seed,
        "settings": {
            "minutes": s.minutes,
            "mean_interval_s": s.mean_interval_s,
            "faults": [k.value for k in s.kinds],
            "nodes": s.nodes,
            "min_nodes": s.min_nodes,
            "max_nodes": s.max_nodes,
            "etcd_members": s.etcd_members,
            "etcd_outage_s": s.etcd_outage_s,
            "step_sleep_s": s.step_sleep_s,
            "steps": s.steps,
            "warmup_s": s.warmup_s,
            "lease_ttl_s": ev.lease_ttl_s,
            "netns": s.netns,
            "link_down_s": s.link_down_s,
        },
        "injected": injected_counts(report),
        "skipped": dict(report.skipped),
        "invariants": [{"name": i.name, "ok": i.ok, "detail": i.detail} for i in v.invariants],
        "stalls": [
            {
                "start_s": round(st.start - rel, 3),
                "length_s": round(st.length_s, 3),
                "excused_s": round(st.excused_s, 3),
                "generations": list(st.generations),
                "faults": list(st.faults),
            }
            for st in v.stalls
        ],
        "etcd_down": [
            {"start_s": round(w.start - rel, 3), "length_s": round(w.end - w.start, 3)} for w in ev.etcd_down
        ],
        "link_down": [
            {
                "node": d.node,
                "start_s": round(d.start - rel, 3),
                "length_s": None if d.end == math.inf else round(d.end - d.start, 3),
            }
            for d in ev.link_down
        ],
        "faults": [
            {"t_s": round(f.t - rel, 3), "kind": f.kind, "target": f.target, "detail": f.detail} for f in ev.faults
        ],
        "ettr": v.ettr,
        "ettr_single_baseline": v.ettr_single,
        "ettr_quiet_steps": v.ettr_quiet,
        "quiet_step_s_by_world": {str(w): t for w, t in v.quiet_step_s_by_world.items()},
        "cost_by_kind": {k: {"faults": n, "lost_s": round(s_, 3)} for k, (n, s_) in v.cost_by_kind.items()},
        "cost_baseline": v.cost_baseline or None,  # "quiet steps" or "warm-up": what cost_by_kind counts against
        "fault_free_step_s": v.step_s,
        "fault_free_step_s_by_world": {str(w): t for w, t in v.step_s_by_world.items()},
        "faulted_steps": v.faulted_steps,
        "faulted_steps_by_world": {str(w): n for w, n in v.faulted_steps_by_world.items()},
        "ettr_baseline_substituted": {str(w): u for w, u in v.substituted.items()},
        "faulted_s": None if ev.faulted is None else ev.faulted.end - ev.faulted.start,
        "steps": v.steps.last_step,
        "target_steps": ev.target_steps,
        "generations": len(v.steps.generations),
        "steps_discarded": dict(ev.discarded),
        "repeats": {str(k): list(g) for k, g in v.steps.repeats.items()},
        "lost": list(v.steps.lost),
        "status_samples": len(ev.samples),
        "tracebacks": list(ev.tracebacks),
        "problems": list(ev.problems),
        "workdir": report.workdir,
    }
