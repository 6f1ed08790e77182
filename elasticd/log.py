"""Logging: ``configure_logging()``, fields bound to a thread's lines (``bind_context``: node,
member) and the process' moment on every line (``set_moment``: generation, rank, step).

Owns the structlog configuration. JSON lines on stdout when stdout is not a TTY (journald and the
tests read them), pretty console output on a TTY. Never configures anything at import time; every
process (agents and spawned workers alike) calls ``configure_logging`` itself.

Why a moment beside the context: a thread's context variables are its own, so the generation and
step that the training thread bound reached the other threads (the coordinator's, the keepalive's)
as they were when those started, or not at all: ``generation_published`` said step 13 after step
25. ``set_moment`` is one dict update per commit; a processor adds the moment to every line of every
thread, unless the line names the field itself.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog for this process.

    Args:
        json: force JSON (True) or console (False) output; by default JSON unless stdout is a TTY.
        level: the lowest level that is printed.
    """
    use_json = (not sys.stdout.isatty()) if json is None else json
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        add_moment,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if use_json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line: workers share the agent's stdout, and two writes per line interleave.
        logger_factory=structlog.WriteLoggerFactory(sys.stdout),
        # Not cached: a cached module logger ignores structlog.testing.capture_logs, and at
        # elasticd's log rate (per rendezvous, a step line at most once a second) caching saves nothing.
        cache_logger_on_first_use=False,
    )


_MOMENT: dict[str, object] = {}  # the process' generation, rank and step now (set_moment)


def set_moment(**fields: object) -> None:
    """Set fields (generation, rank, step) that every later line of every thread of this process
    carries (a line that names one itself keeps its own)."""
    _MOMENT.update(fields)


def add_moment(_logger: object, _name: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """The structlog processor of ``set_moment``."""
    for k, v in tuple(_MOMENT.items()):
        event.setdefault(k, v)
    return event


def bind_context(**fields: object) -> None:
    """Bind fields (node, generation, rank, step, ...) to every later log line of this thread/task."""
    structlog.contextvars.bind_contextvars(**fields)


def clear_context() -> None:
    """Drop every bound field, and the moment."""
    structlog.contextvars.clear_contextvars()
    _MOMENT.clear()
