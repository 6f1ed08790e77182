"""What a worker leaves behind when its script raises: a failure record, and an exit code.

``install(env)`` (called as an ``ElasticTrainer`` or ``DistributedDataParallel`` is made) chains a
``sys.excepthook``: when an exception escapes the script's main thread, it prints it as Python
does, then writes the job's ``failures/<member>`` record (``wire.failures``: the step being
computed, the exception's type, its normalized message, the traceback's tail; best effort,
bounded by ``etcd_request_s``), so that the agents tell a bug (the same exception at the same step
twice) from a fault. A ``ConfigError`` or ``ModelMismatch`` (a restart cannot cure either) then
ends the process with ``EXIT_NO_RESTART``: its agent stops instead of restarting it.
``attach(trainer)`` names the trainer whose member, generation and step the record gives (held
weakly: the hook keeps no trainer alive).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
import weakref
from types import TracebackType
from typing import TYPE_CHECKING

from elasticd.config import WorkerEnv
from elasticd.errors import EXIT_NO_RESTART, ConfigError, ModelMismatch
from elasticd.rendezvous.member import new_member_id
from elasticd.store.kv import KeyValueStore
from elasticd.wire.failures import DETAIL_CHARS, FailureRecord, encode_failure, normalize
from elasticd.wire.keys import Keys

if TYPE_CHECKING:
    from elasticd.worker.trainer import ElasticTrainer

# Exceptions that no restart cures: the worker exits EXIT_NO_RESTART after its record.
NOT_RESTARTABLE: tuple[type[BaseException], ...] = (ConfigError, ModelMismatch)


class _Hook:
    def __init__(self) -> None:
        self.env: WorkerEnv | None = None
        self.trainer: weakref.ref[ElasticTrainer] | None = None
        self.previous = sys.excepthook

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        self.previous(exc_type, exc, tb)
        if self.env is None or not issubclass(exc_type, Exception):
            return  # KeyboardInterrupt and the like: no script bug
        try:
            record(self.env, self.trainer() if self.trainer else None, exc, tb)
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


def attach(trainer: ElasticTrainer) -> None:
    """The trainer whose member, generation and step a failure record gives."""
    if _hook is not None:
        _hook.trainer = weakref.ref(trainer)


def failure_record(
    env: WorkerEnv, trainer: ElasticTrainer | None, exc: BaseException, tb: TracebackType | None, now: float
) -> FailureRecord:
    """The record of ``exc`` raised in this worker. Pure but for reading the trainer."""
    membership = trainer._membership if trainer is not None else None
    member = membership.member_id if membership is not None else new_member_id(env.node_id, env.local_rank)
    generation = 0
    if trainer is not None and trainer.joined is not None:
        generation = trainer.joined.record.generation
    step = trainer.state.counters.step + 1 if trainer is not None else 0
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return FailureRecord(
        member=member,
        node=env.node_id,
        local_rank=env.local_rank,
        generation=generation,
        step=step,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=normalize(str(exc)),
        detail=text[-DETAIL_CHARS:],
        time=now,
    )


def record(env: WorkerEnv, trainer: ElasticTrainer | None, exc: BaseException, tb: TracebackType | None) -> None:
    """Write ``failures/<member>`` through the trainer's store, or a client of its own (two
    attempts of ``etcd_request_s`` each)."""
    rec = failure_record(env, trainer, exc, tb, time.time())
    key, value = Keys(env.etcd.prefix, env.world.job_id).failure(rec.member), encode_failure(rec)
    store: KeyValueStore | None = trainer._store if trainer is not None else None
    if store is not None:
        store.put(key, value)
        return
    from elasticd.store.etcd import EtcdClient

    client = EtcdClient(env.etcd, env.timeouts, dataclasses.replace(env.retry, etcd_attempts=2))
    try:
        client.put(key, value)
    finally:
        client.close()
