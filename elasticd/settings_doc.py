"""``docs/settings.md``, rendered from the settings table (pure).

Owns the page that lists every setting of the node agent (``settings.AGENT_SETTINGS``: a flag, an
``ELASTICD_*`` variable and a TOML key each) and every variable a worker reads
(``settings.WORKER_VARIABLES``), grouped as essential, tuning, set by the agent, and testing only;
each with its default, unit and documentation, all read from the dataclass fields of ``config``.
``python -m elasticd.settings_doc > docs/settings.md`` writes it; ``tests/unit/test_settings_doc.py``
fails when the file is stale. Never reads the environment or a file.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping

from elasticd.settings import (
    _CLASSES,
    AGENT_SETTINGS,
    WORKER_VARIABLES,
    Setting,
)

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


def default_text(setting: Setting) -> str:
    """The default of ``setting`` as the page shows it (a computed default by what computes it)."""
    f = next(f for f in dataclasses.fields(_CLASSES[setting.section]) if f.name == setting.attr)
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        name = getattr(factory, "__name__", "")
        if name in ("gethostname",):
            return "the host name"
        value = factory()
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


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
