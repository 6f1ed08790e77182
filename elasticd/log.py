"""Logging: ``configure_logging()`` and binding node, generation, rank and step to the context.

Owns the structlog configuration. JSON lines on stdout when stdout is not a TTY (journald and the
tests read them), pretty console output on a TTY. Never configures anything at import time; every
process (agents and spawned workers alike) calls ``configure_logging`` itself.
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


def bind_context(**fields: object) -> None:
    """Bind fields (node, generation, rank, step, ...) to every later log line of this thread/task."""
    structlog.contextvars.bind_contextvars(**fields)


def clear_context() -> None:
    """Drop every bound field."""
    structlog.contextvars.clear_contextvars()
