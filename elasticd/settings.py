"""The one loader of settings: command-line flags, ``ELASTICD_*`` variables and the TOML file.

Owns the table of settings (``Setting``: each is a TOML key ``name``, a variable ``ELASTICD_<NAME>``
and a flag ``--<name>``), the one converter of a setting's text (``from_text``), the node agent's
loader (``load_agent_config``: flag > variable > file > default), the worker environment contract
both ways (``worker_env_from_environ``, ``worker_env_to_environ``), the checks that touch the
filesystem (the etcd certificate and password files, ``checkpoint_dir``, ``audit_dir``, the program), and the
environments around the agent: of the processes it starts (``child_environ``) and what systemd
hands it (``systemd_notify_environ``). It is the only module of the library that reads
``os.environ``.

It never holds a default or a validation rule of a value (``config.py`` does), and is imported
only by the entry points, the agent (its workers' environment) and the worker (``WorkerEnv``'s
default).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import tomllib

from elasticd.config import (
    AgentConfig,
    CheckpointConfig,
    EtcdConfig,
    RetryPolicy,
    Timeouts,
    WorkerEnv,
    WorldConfig,
)
from elasticd.errors import ConfigError

ENV_PREFIX = "ELASTICD_"
CONFIG_FILE_VARIABLE = f"{ENV_PREFIX}CONFIG"
DEFAULT_CONFIG_FILE = Path("/etc/elasticd/elasticd.toml")


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting: TOML key ``name``, variable ``ELASTICD_<NAME>``, flag ``--<name>``."""

    name: str
    section: str  # the dataclass that holds it: world, etcd, timeouts, retry, checkpoint, worker or agent
    attr: str  # its field there
    kind: type  # int, float, str, bool, or tuple (a list of strings)
    doc: str
    from_env: bool = True

    @property
    def variable(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def field(self) -> dataclasses.Field[object]:
        """Its field in its section's dataclass (default, documentation)."""
        return next(f for f in dataclasses.fields(_CLASSES[self.section]) if f.name == self.attr)


_CLASSES: Mapping[str, type] = {
    "world": WorldConfig,
    "etcd": EtcdConfig,
    "timeouts": Timeouts,
    "retry": RetryPolicy,
    "checkpoint": CheckpointConfig,
    "worker": WorkerEnv,
    "agent": AgentConfig,
}
_NESTED = ("world", "etcd", "timeouts", "retry", "checkpoint")  # fields that hold a section, not a setting
_EXTRA_DOCS = {
    "job_id": "The job this node's workers join.",
    "min_workers": "Smallest world size the job trains at.",
    "max_workers": "Largest world size; further workers wait.",
    "etcd_endpoints": "etcd endpoints, host:port, or https://host:port for TLS (several for an etcd cluster).",
    "etcd_prefix": "Key prefix of all jobs in etcd.",
}


def _default_of(f: dataclasses.Field[object]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ""


def _table(sections: Sequence[str]) -> dict[str, Setting]:
    """The settings of ``sections``' dataclasses, by name (etcd's fields are named ``etcd_<field>``)."""
    out: dict[str, Setting] = {}
    for section in sections:
        for f in dataclasses.fields(_CLASSES[section]):
            if f.name in _NESTED:
                continue
            name = ("etcd_" if section == "etcd" else "") + f.name
            like = _default_of(f)
            kind: type = str if like is None else type(like)
            doc = str(f.metadata.get("doc", _EXTRA_DOCS.get(name, "")))
            assert name not in out, f"setting {name} defined twice"
            out[name] = Setting(name, section, f.name, kind, doc, from_env=name != "program")
    return out


# The node agent's settings: a flag, a variable and a TOML key each (the program is not a variable).
_AGENT_SECTIONS = ("world", "etcd", "timeouts", "retry", "checkpoint", "agent")
AGENT_SETTINGS: Mapping[str, Setting] = _table(_AGENT_SECTIONS)
# The worker environment contract, in the order ``worker_env_to_environ`` writes it.
WORKER_VARIABLES: Mapping[str, Setting] = _table(("etcd", "world", "timeouts", "retry", "checkpoint", "worker"))

_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", tuple: "a list of strings", bool: "true or false"}
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def from_text(kind: type, raw: str) -> object:
    """The value that a setting's text (a variable's or a flag's) stands for.

    Args:
        kind: the setting's type: ``int``, ``float``, ``bool`` (1/true/yes/on, 0/false/no/off),
            ``tuple`` (a comma-separated list) or ``str``.
        raw: the text; surrounding blanks do not count.

    Raises:
        ValueError: ``raw`` is not a value of ``kind``.
    """
    text = raw.strip()
    if kind is bool:
        if text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.lower() in _TRUE_WORDS
        raise ValueError(f"not a boolean: {raw!r}")
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


def _from_toml(setting: Setting, raw: object, where: str) -> object:
    kind = setting.kind
    ok = (
        (kind is bool and isinstance(raw, bool))
        or (kind is int and isinstance(raw, int) and not isinstance(raw, bool))
        or (kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool))
        or (kind is str and isinstance(raw, str))
        or (kind is tuple and isinstance(raw, list) and all(isinstance(x, str) for x in raw))
    )
    if not ok:
        raise ConfigError(f"{setting.name}: expected {_KIND_WORDS[kind]}, got {raw!r} ({type(raw).__name__}) {where}")
    if kind is float:
        return float(raw)  # type: ignore[arg-type]
    if kind is tuple:
        return tuple(raw)  # type: ignore[arg-type]
    return raw


def _agent_value(setting: Setting, raw: str, where: str) -> object:
    try:
        return from_text(setting.kind, raw)
    except ValueError as exc:
        raise ConfigError(f"{setting.name}: expected {_KIND_WORDS[setting.kind]}, got {raw!r} ({where})") from exc


_T = TypeVar("_T")


def _build(cls: type[_T], kwargs: Mapping[str, object], where: str) -> _T:
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


# -- files ------------------------------------------------------------------------------------


def etcd_config(values: Mapping[str, object], where: str = "etcd") -> EtcdConfig:
    """``EtcdConfig`` from its fields' values, with the certificate and password files it names checked.

    Raises:
        ConfigError: a value is invalid, or a file it names does not exist; the message names the setting.
    """
    # The address is judged before the files, and the files before how the TLS and auth settings
    # go together: the order in which these errors have always been reported.
    _build(EtcdConfig, {k: v for k, v in values.items() if k in ("endpoints", "prefix")}, where)
    for name in ("ca_cert", "cert_cert", "cert_key", "password_file"):
        path = values.get(name)
        if path and not Path(str(path)).is_file():
            raise ConfigError(f"etcd_{name}: no such file: {path!r}")
    return _build(EtcdConfig, values, where)


def _check_directory(name: str, directory: str | Path | None) -> None:
    """An unset or empty ``directory`` is none; one that exists must be a directory."""
    path = Path(directory) if directory else None
    if path is not None and path.exists() and not path.is_dir():
        raise ConfigError(f"{name}: {path} exists and is not a directory")


def _check_program(program: tuple[str, ...]) -> None:
    """The program can start: its executable exists, and a Python script it names is a file. Checked
    before the first worker starts, so that a typo is one clear error, not a restart loop."""
    exe = program[0]
    found = shutil.which(exe) if os.sep not in exe else (exe if os.access(exe, os.X_OK) else None)
    if found is None or os.path.isdir(found):
        raise ConfigError(f"program: {exe!r} is not an executable file or a command on PATH")
    script = python_script(program)
    if script is not None and not os.path.isfile(script):
        what = "is a directory, not a script" if os.path.isdir(script) else "no such file"
        raise ConfigError(f"program: {script!r}: {what} (the script {exe} would run, from {os.getcwd()})")


# Python's options that take the next argument as their value (``python -W error script.py``).
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def python_script(program: Sequence[str]) -> str | None:
    """The script a Python interpreter in ``program`` would run: its first argument that is not an
    option. None when ``program`` is not a Python interpreter, or it runs ``-m``, ``-c`` or stdin
    (``-``). Pure."""
    if not os.path.basename(program[0]).startswith("python"):
        return None
    args = iter(program[1:])
    for arg in args:
        if arg in _PYTHON_OPTIONS_WITH_VALUE:
            next(args, None)
        elif arg == "-" or arg.startswith(("-m", "-c")) or arg == "--":
            return None if arg != "--" else next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


# -- the worker environment contract ----------------------------------------------------------

# The order in which a worker's sections are read and validated (so, which bad one is reported).
_WORKER_ORDER = ("world", "etcd", "worker", "timeouts", "retry", "checkpoint")
ETCD_SECURITY_FIELDS = ("ca_cert", "cert_cert", "cert_key", "user", "password", "password_file", "insecure")


def worker_env_from_environ(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """Parse the worker environment contract (``ELASTICD_*`` variables; others are ignored).

    Args:
        environ: the environment (default: ``os.environ``).

    Raises:
        ConfigError: a variable is malformed or a value invalid; the message names it.
    """
    env = os.environ if environ is None else environ
    parts: dict[str, object] = {}
    own: dict[str, object] = {}
    for section in _WORKER_ORDER:
        values: dict[str, object] = {}
        for s in WORKER_VARIABLES.values():
            if s.section == section and s.variable in env:
                raw = env[s.variable]
                try:
                    values[s.attr] = from_text(s.kind, raw)
                except ValueError as exc:
                    raise ConfigError(f"{s.variable}: expected a {s.kind.__name__}, got {raw!r}") from exc
        if section == "worker":
            own = values
            _build(WorkerEnv, own, "WorkerEnv")  # its own fields are judged before the timeouts
        elif section == "etcd":
            parts[section] = etcd_config(values, "ELASTICD_ETCD_")
        else:
            parts[section] = _build(_CLASSES[section], values, _CLASSES[section].__name__)
    return _build(WorkerEnv, {**own, **parts}, "WorkerEnv")


def worker_env_to_environ(env: WorkerEnv) -> dict[str, str]:
    """The variables that make ``worker_env_from_environ`` return ``env`` (for launchers). The etcd
    TLS and auth settings travel only when set (a password given by file, as the file's name)."""
    out: dict[str, str] = {}
    for s in WORKER_VARIABLES.values():
        value = getattr(env if s.section == "worker" else getattr(env, s.section), s.attr)
        if s.section == "etcd" and s.attr in ETCD_SECURITY_FIELDS and not value:
            continue
        out[s.variable] = ",".join(value) if s.kind is tuple else str(value)
    return out


def etcd_security_environ(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The etcd TLS and auth settings in ``ELASTICD_ETCD_*`` variables (field -> value; ConfigError: not a boolean)."""
    env = os.environ if environ is None else environ
    return {
        s.attr: _agent_value(s, env[s.variable], f"from {s.variable}")
        for s in WORKER_VARIABLES.values()
        if s.section == "etcd" and s.attr in ETCD_SECURITY_FIELDS and s.variable in env
    }


def without_etcd_security(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment minus the etcd TLS and auth variables (for a caller that takes those from
    elsewhere too, such as elasticctl's flags, and validates them together itself)."""
    env = os.environ if environ is None else environ
    drop = {f"{ENV_PREFIX}ETCD_{name.upper()}" for name in ETCD_SECURITY_FIELDS}
    return {k: v for k, v in env.items() if k not in drop}


# -- the environment around the agent ---------------------------------------------------------

SYSTEMD_NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def systemd_notify_environ(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """What systemd tells a ``Type=notify`` service: ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``,
    ``WATCHDOG_PID`` (each None when unset)."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in SYSTEMD_NOTIFY_VARIABLES}


def child_environ(extra: Mapping[str, str], defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process the agent starts: its own, with ``extra`` on top, and
    ``defaults`` (such as ``nccl_environ``) wherever the agent's own environment leaves them unset.

    Output is unbuffered unless the caller says otherwise, so a worker's last lines before a crash
    reach the agent's log. systemd's notify variables are the agent's alone: a worker must not
    talk to systemd for it.
    """
    env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_NOTIFY_VARIABLES}
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name, value in (defaults or {}).items():
        env.setdefault(name, value)
    env.update(extra)
    return env


# -- NCCL's environment (why each value: ``worker/group/nccl.py``) --------------------------------------


def nccl_environ(timeouts: Timeouts) -> dict[str, str]:
    """What torch's ``ProcessGroupNCCL`` must read for a group that can fail without taking the
    survivors down. The worker sets these as defaults before its first NCCL group; the elastic
    agent passes them to its workers. ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (whole seconds) is at most
    ``group_build_s`` and half of ``group_abort_s``."""
    nonblocking_s = max(1, int(min(timeouts.group_build_s, timeouts.group_abort_s / 2)))
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(nonblocking_s),
    }


def environ_defaults(defaults: Mapping[str, str]) -> dict[str, str]:
    """Set each of ``defaults`` in this process's environment where it is unset (a value the
    operator set wins); returns the values now in effect."""
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in defaults}


def default_nproc_per_node(environ: Mapping[str, str] | None = None) -> int:
    """One worker per device listed in ``CUDA_VISIBLE_DEVICES``; 1 when it is unset or empty.

    The agent imports no torch, so it cannot ask CUDA; this variable is what a scheduler sets.
    """
    env = os.environ if environ is None else environ
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(1, len(devices))


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` nodes.

    Raises:
        ConfigError: not ``N`` or ``MIN:MAX`` with ``1 <= MIN <= MAX``.
    """
    lo_text, sep, hi_text = text.strip().partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError as exc:
        raise ConfigError(f"nnodes: expected N or MIN:MAX, got {text!r}") from exc
    if lo < 1 or hi < lo:
        raise ConfigError(f"nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


# -- the node agent's loader ------------------------------------------------------------------


def _config_path(explicit: str | Path | None, env: Mapping[str, str], default: Path) -> Path | None:
    if explicit is not None:
        where = "--config"
        path = Path(explicit)
    elif CONFIG_FILE_VARIABLE in env:
        where = CONFIG_FILE_VARIABLE
        path = Path(env[CONFIG_FILE_VARIABLE])
    else:
        return default if default.is_file() else None
    if not path.is_file():
        why = "a directory, not a TOML file" if path.is_dir() else "no such file"
        raise ConfigError(f"config: {why}: {str(path)!r} (from {where})")
    return path


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib decodes before it parses
        raise ConfigError(f"config: {path} is not UTF-8 text (byte {exc.start}): TOML files are UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc


def load_agent_config(
    flags: Mapping[str, str | None] | None = None,
    *,
    program: Sequence[str] = (),
    nnodes: str | None = None,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    default_config_file: Path = DEFAULT_CONFIG_FILE,
) -> AgentConfig:
    """Load the agent's settings: flag > ``ELASTICD_*`` variable > TOML file > default.

    Args:
        flags: setting name -> the flag's text, for the flags given (None: not given).
        program: the program from the command line (overrides ``program`` in the file).
        nnodes: torchrun's ``--nnodes N|MIN:MAX``: ``min_workers``/``max_workers`` become
            ``MIN``/``MAX`` times ``nproc_per_node``.
        config_file: ``--config``; else ``$ELASTICD_CONFIG``; else ``default_config_file`` if it exists.
        environ: the environment (default: ``os.environ``).
        default_config_file: the file read when none is named.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: a setting is unknown, ill-typed or invalid, or no program is given; the
            message has one line per bad field, naming it and where its value came from.
    """
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    errors: list[str] = []
    path = _config_path(config_file, env, default_config_file)
    if path is not None:
        where = f"in {path}"
        for key, raw in _read_toml(path).items():
            known = AGENT_SETTINGS.get(key)
            if known is None:
                close = difflib.get_close_matches(key, list(AGENT_SETTINGS), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                errors.append(f"{key}: unknown setting {where}{hint}")
                continue
            try:
                values[key] = _from_toml(known, raw, where)
                sources[key] = where
            except ConfigError as exc:
                errors.append(str(exc))
    for known in AGENT_SETTINGS.values():
        if known.from_env and known.variable in env:
            try:
                values[known.name] = _agent_value(known, env[known.variable], f"from {known.variable}")
                sources[known.name] = f"from {known.variable}"
            except ConfigError as exc:
                errors.append(str(exc))
    for name, raw in given.items():
        known = AGENT_SETTINGS[name]  # the command line offers only known settings
        try:
            values[name] = _agent_value(known, raw, f"from {known.flag}")
            sources[name] = f"from {known.flag}"
        except ConfigError as exc:
            errors.append(str(exc))
    if program:
        values["program"] = tuple(program)
        sources["program"] = "from the command line"
    if errors:
        raise ConfigError("\n".join(errors))
    if "nproc_per_node" not in values:
        values["nproc_per_node"] = default_nproc_per_node(env)
        if "CUDA_VISIBLE_DEVICES" in env:
            sources["nproc_per_node"] = "from CUDA_VISIBLE_DEVICES"
    if nnodes is not None:
        if "min_workers" in given or "max_workers" in given:
            raise ConfigError("nnodes: give either --nnodes or --min-workers/--max-workers, not both")
        nproc = values["nproc_per_node"]
        if not isinstance(nproc, int) or nproc < 1:
            raise ConfigError(
                f"nproc_per_node: must be an integer >= 1, got {nproc!r} ({sources.get('nproc_per_node', 'default')})"
            )
        lo, hi = parse_nnodes(nnodes)
        values["min_workers"], values["max_workers"] = lo * nproc, hi * nproc
        sources["min_workers"] = sources["max_workers"] = "from --nnodes"
    prog = values.get("program")
    if isinstance(prog, tuple) and prog and str(prog[0]).endswith(".py"):
        values["program"] = (sys.executable, *prog)
    audit_dir = values.get("audit_dir")
    if isinstance(audit_dir, str):
        values["audit_dir"] = Path(audit_dir) if audit_dir else None
    try:
        config = _assemble(values)
        _check_directory("checkpoint_dir", config.checkpoint.checkpoint_dir)
        _check_directory("audit_dir", config.audit_dir)
    except ConfigError as exc:
        raise ConfigError(_with_sources(str(exc), sources)) from exc
    _check_program(config.program)
    return config


def _with_sources(message: str, sources: Mapping[str, str]) -> str:
    """Say where the values a validation message talks about came from."""
    named = message.split(":", 1)[0]
    mentioned = [n for n in sources if n != named and re.search(rf"\b{n}\b", message)]
    if named in sources and not mentioned:
        return f"{message} ({sources[named]})"
    notes = [f"{n} {sources[n]}" for n in ([named] if named in sources else []) + mentioned]
    return f"{message} ({'; '.join(notes)})" if notes else message


def _assemble(values: Mapping[str, object]) -> AgentConfig:
    parts: dict[str, dict[str, object]] = {section: {} for section in _AGENT_SECTIONS}
    for name, value in values.items():
        known = AGENT_SETTINGS[name]
        parts[known.section][known.attr] = value
    top: dict[str, object] = dict(parts["agent"])
    top["world"] = _build(WorldConfig, parts["world"], "world")
    top["etcd"] = etcd_config(parts["etcd"], "etcd")
    top["timeouts"] = _build(Timeouts, parts["timeouts"], "timeouts")
    top["retry"] = _build(RetryPolicy, parts["retry"], "retry")
    top["checkpoint"] = _build(CheckpointConfig, parts["checkpoint"], "checkpoint")
    return _build(AgentConfig, top, "agent")
