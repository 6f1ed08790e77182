"""What a worker leaves behind when its script raises: a failure record, and an exit code.

``install(env)`` (called as an ``ElasticTrainer`` or ``DistributedDataParallel`` is made) chains a
``sys.excepthook``: when an exception escapes the script's main thread, it prints it as Python
does, then writes the job's ``failures/<member>`` record (``wire.failures``: the step being
computed, the exception's type, its normalized message, the traceback's tail; best effort,
bounded by ``etcd_request_s``), so that the agents tell a bug (the same exception at the same step
twice) from a fault. A ``ConfigError``, ``ModelMismatch`` or ``GradientsNotFinite`` (a restart
cannot cure them) then ends the process with ``EXIT_NO_RESTART``: its agent stops instead of restarting it.
``attach(context)`` names the trainer's method that says where the worker stands (its member,
generation, step and store; held weakly: the hook keeps no trainer alive).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from elasticd.config import WorkerEnv
from elasticd.errors import EXIT_NO_RESTART, ConfigError, GradientsNotFinite, ModelMismatch
from elasticd.rendezvous.member import new_member_id
from elasticd.store.kv import KeyValueStore
from elasticd.wire.failures import DETAIL_CHARS, FailureRecord, encode_failure, normalize
from elasticd.wire.keys import Keys
from elasticd.worker.rejoin import etcd_client

# Attempts of the failure record's put on a client of its own: the process is ending, so a short bound.
RECORD_ATTEMPTS = 2
# Exceptions that no restart cures: the worker exits EXIT_NO_RESTART after its record.
NOT_RESTARTABLE: tuple[type[BaseException], ...] = (ConfigError, ModelMismatch, GradientsNotFinite)


@dataclass(frozen=True)
class Context:
    """Where the worker stands, for its failure record (``ElasticTrainer._failure_context``)."""

    member: str  # its member id ("" before it registered)
    generation: int  # the generation it was in (0: none yet)
    step: int  # the step it was computing
    store: KeyValueStore | None  # its store client (None: not connected yet)


class _Hook:
    def __init__(self) -> None:
        self.env: WorkerEnv | None = None
        self.context: weakref.WeakMethod[Callable[[], Context]] | None = None
        self.previous = sys.excepthook

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        self.previous(exc_type, exc, tb)
        if self.env is None or not issubclass(exc_type, Exception):
            return  # KeyboardInterrupt and the like: no script bug
        try:
            where = self.context() if self.context is not None else None
            record(self.env, where() if where is not None else None, exc, tb)
        except Exception as err:  # the record is best effort; the exit must happen
            print(f"elasticd: the failure record was not written: {err!r}", file=sys.stderr)
        if isinstance(exc, NOT_RESTARTABLE):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_NO_RESTART)


_hook: _Hook | None = None


def install(env: WorkerEnv) -> None:
    """Record this worker's uncaught exception for the job (once per process; a later call
    updates the settings it uses)."""
    global _hook
    if _hook is None or sys.excepthook is not _hook:
        _hook = _Hook()
        sys.excepthook = _hook
    _hook.env = env


def attach(context: Callable[[], Context]) -> None:
    """The bound method that says where the worker stands (held weakly: the hook keeps no
    trainer alive)."""
    if _hook is not None:
        _hook.context = weakref.WeakMethod(context)  # type: ignore[arg-type]


def failure_record(
    env: WorkerEnv, where: Context | None, exc: BaseException, tb: TracebackType | None, now: float
) -> FailureRecord:
    """The record of ``exc`` raised in this worker. Pure."""
    member = where.member if where is not None and where.member else new_member_id(env.node_id, env.local_rank)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return FailureRecord(
        member=member,
        node=env.node_id,
        local_rank=env.local_rank,
        generation=where.generation if where is not None else 0,
        step=where.step if where is not None else 0,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=normalize(str(exc)),
        detail=text[-DETAIL_CHARS:],
        time=now,
    )


def record(env: WorkerEnv, where: Context | None, exc: BaseException, tb: TracebackType | None) -> None:
    """Write ``failures/<member>`` through the worker's store, or a client of its own
    (``RECORD_ATTEMPTS`` attempts of ``etcd_request_s`` each)."""
    rec = failure_record(env, where, exc, tb, time.time())
    key, value = Keys(env.etcd.prefix, env.world.job_id).failure(rec.member), encode_failure(rec)
    if where is not None and where.store is not None:
        where.store.put(key, value)
        return
    client = etcd_client(env, attempts=RECORD_ATTEMPTS)
    try:
        client.put(key, value)
    finally:
        client.close()  # type: ignore[attr-defined]
