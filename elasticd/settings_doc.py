"""``docs/settings.md`` and ``systemd/elasticd.toml.example``, rendered from the settings table (pure).

Owns the page that lists every setting of the node agent (``settings.AGENT_SETTINGS``: a flag, an
``ELASTICD_*`` variable and a TOML key each) and every variable a worker reads
(``settings.WORKER_VARIABLES``), grouped as essential, tuning, set by the agent, and testing only;
each with its default, unit and documentation, all read from the dataclass fields of ``config``.
The TOML example is the agent's settings in the same table, each with its documentation, its
default (or an example value) and what an operator of a systemd node should know (``TOML_NOTES``).
``python -m elasticd.settings_doc > docs/settings.md`` and ``python -m elasticd.settings_doc --toml >
systemd/elasticd.toml.example`` write them; ``tests/unit/test_settings_doc.py`` fails when either
is stale. Never reads the environment or a file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from collections.abc import Iterable, Mapping

from elasticd.settings import AGENT_SETTINGS, WORKER_VARIABLES, Setting

# The agent settings a new job sets; the rest tune it.
ESSENTIAL = (
    "job_id",
    "etcd_endpoints",
    "min_workers",
    "max_workers",
    "nproc_per_node",
    "node_id",
    "advertise_addr",
    "mode",
    "backend",
    "checkpoint_dir",
    "program",
)
# Worker variables that only tests and the fault-injection tools set.
TESTING_ONLY = ("stop_after_sum", "miss_sum_at", "kill_after_apply")

REGENERATE = "python -m elasticd.settings_doc > docs/settings.md"
REGENERATE_TOML = "python -m elasticd.settings_doc --toml > systemd/elasticd.toml.example"

# The TOML example's values where they are not the defaults: what a multi-node job sets.
TOML_EXAMPLES: dict[str, object] = {
    "job_id": "mlp-elastic",
    "etcd_endpoints": ["10.0.0.11:2379", "10.0.0.12:2379", "10.0.0.13:2379"],
    "min_workers": 2,
    "max_workers": 8,
    "program": ["/usr/bin/python3", "-m", "agents.mlp"],
    "checkpoint_dir": "/var/lib/elasticd/checkpoints",
    "metrics_port": 9780,
}
# What an operator of a systemd node should know besides a setting's own documentation.
TOML_NOTES: dict[str, str] = {
    "node_id": "Usually set per node in /etc/elasticd/elasticd.env (ELASTICD_NODE_ID), so that this "
    "file can be the same on every node.",
    "advertise_addr": "The default only works when the whole job runs on one machine: set it per node "
    "(ELASTICD_ADVERTISE_ADDR in elasticd.env) to the fast interconnect's address.",
    "checkpoint_dir": "It must be writable under the unit's ProtectSystem=strict: the unit allows "
    "/var/lib/elasticd; add a ReadWritePaths= line to the unit if you move it, owned by the user "
    "elasticd (mode 0750).",
}
# Shown commented out though they have a default: computed where the agent runs (one worker per
# visible GPU), or set per node in elasticd.env.
TOML_COMMENTED = ("nproc_per_node", "advertise_addr")
TOML_SECTIONS = {
    "world": "the job",
    "etcd": "etcd",
    "timeouts": "timeouts (seconds)",
    "retry": "etcd retries",
    "checkpoint": "durable checkpoints",
    "agent": "this node and its workers",
}


def default_text(setting: Setting) -> str:
    """The default of ``setting`` as the page shows it (a computed default by what computes it)."""
    f = setting.field
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        if getattr(f.default_factory, "__name__", "") == "gethostname":
            return "the host name"
        value = f.default_factory()
    else:
        return "(required)"
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def unit_text(setting: Setting) -> str:
    """ "s" for durations (``*_s``), else empty."""
    return "s" if setting.name.endswith("_s") else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(settings: Iterable[Setting], *, agent: bool) -> list[str]:
    head = (
        "| setting | flag | variable | default | unit | what it does |"
        if agent
        else "| variable | default | unit | what it does |"
    )
    rule = "|---|---|---|---|---|---|" if agent else "|---|---|---|---|"
    lines = [head, rule]
    for s in settings:
        default, unit, doc = _cell(default_text(s)), unit_text(s), _cell(s.doc) or "-"
        if agent:
            variable = f"`{s.variable}`" if s.from_env else "-"
            flag = f"`{s.flag}`" if s.name != "program" else "after `--`"
            lines.append(f"| `{s.name}` | {flag} | {variable} | {default} | {unit} | {doc} |")
        else:
            lines.append(f"| `{s.variable}` | {default} | {unit} | {doc} |")
    return lines


def render(agent: Mapping[str, Setting] = AGENT_SETTINGS, worker: Mapping[str, Setting] = WORKER_VARIABLES) -> str:
    """The whole page."""
    essential = [agent[n] for n in ESSENTIAL if n in agent]
    tuning = [s for n, s in agent.items() if n not in ESSENTIAL]
    by_agent = [s for n, s in worker.items() if n not in TESTING_ONLY]
    testing = [worker[n] for n in TESTING_ONLY if n in worker]
    out = [
        "# Settings",
        "",
        f"Generated from the settings table in the code (`elasticd/config.py`); regenerate with `{REGENERATE}`.",
        "",
        "The node agent's settings are each a flag, an `ELASTICD_*` variable and a key of the TOML file",
        "(`systemd/elasticd.toml.example`), in that order of precedence: flag > variable > file > default.",
        "The agent hands the workers it starts their settings as `ELASTICD_*` variables; a worker started",
        "by other means reads the same variables. Durations are seconds.",
        "",
        "## Essential",
        "",
        "What a job sets.",
        "",
        *_table(essential, agent=True),
        "",
        "## Tuning",
        "",
        "Timeouts, retries, spares, checkpoints and the agent's behaviour: the defaults suit most jobs.",
        "",
        *_table(tuning, agent=True),
        "",
        "## Set by the agent",
        "",
        "The variables a worker reads (`elasticd.worker_env_from_environ`); its agent writes them from its own",
        "settings.",
        "",
        *_table(by_agent, agent=False),
        "",
        "## Testing only",
        "",
        "Fault injection for tests and `python -m elasticd.chaos`; never set them in a real job.",
        "",
        *_table(testing, agent=False),
        "",
    ]
    return "\n".join(out)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def _default_value(setting: Setting) -> object:
    default = setting.field.default
    return None if default is dataclasses.MISSING else default  # None: computed (the host name) or a factory's


def render_toml(agent: Mapping[str, Setting] = AGENT_SETTINGS) -> str:
    """The TOML example: every agent setting, grouped by section, each with its documentation
    above it; active with its default (or ``TOML_EXAMPLES``' value), commented out where it has
    none."""
    out = [
        "# Example configuration of the elasticd node agent. Copy to /etc/elasticd/elasticd.toml.",
        f"# Generated from the settings table (docs/settings.md): {REGENERATE_TOML}",
        "#",
        "# Keys are flat and named like their environment overrides: `lease_ttl_s` here is",
        "# ELASTICD_LEASE_TTL_S in /etc/elasticd/elasticd.env. Precedence: command-line flag >",
        "# ELASTICD_* variable > this file > built-in default. The agent rejects an unknown key.",
        "# Every active value below is the default unless its comment says it is an example.",
    ]
    section = None
    for s in agent.values():
        if s.section != section:
            section = s.section
            title = TOML_SECTIONS.get(section, section)
            out += ["", f"# -- {title} " + "-" * max(3, 96 - len(title)), ""]
        else:
            out.append("")
        doc = " ".join(s.doc.split()) or s.name
        note = TOML_NOTES.get(s.name)
        default = _default_value(s)
        if s.name in TOML_EXAMPLES:
            shown = "none" if default in (None, "", ()) else _toml_value(default)
            doc += f" (Example value; the default is {shown}.)"
        if note:
            doc += " " + note
        out += ["# " + line for line in textwrap.wrap(doc, 98)]
        if s.name in TOML_EXAMPLES:
            out.append(f"{s.name} = {_toml_value(TOML_EXAMPLES[s.name])}")
        elif default in (None, "", ()):
            out.append(f'#{s.name} = ""')
        elif s.name in TOML_COMMENTED:
            out.append(f"#{s.name} = {_toml_value(default)}")
        else:
            out.append(f"{s.name} = {_toml_value(default)}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.write(render_toml() if args == ["--toml"] else render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
