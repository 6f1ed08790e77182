"""``Deadline`` (monotonic) and the named tenacity retry policies.

Owns how elasticd waits and retries. It knows nothing about etcd or torch: callers pass in which
exception types are transient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import structlog
import tenacity

from elasticd.config import RetryPolicy

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Deadline:
    """A point on the monotonic clock; hand ``remaining()`` to each callee."""

    at: float
    clock: Clock = time.monotonic

    @classmethod
    def after(cls, span: timedelta | float, clock: Clock = time.monotonic) -> Deadline:
        seconds = span.total_seconds() if isinstance(span, timedelta) else float(span)
        return cls(clock() + seconds, clock)

    def remaining_s(self) -> float:
        return max(0.0, self.at - self.clock())

    def remaining(self) -> timedelta:
        return timedelta(seconds=self.remaining_s())

    def expired(self) -> bool:
        return self.clock() >= self.at


def call_with_retry(
    fn: Callable[[], _T],
    *,
    policy: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    event: str,
    **fields: object,
) -> _T:
    """Call ``fn``, retrying ``transient`` exceptions with jittered exponential backoff.

    Each retry logs one ``event`` line. After ``policy.etcd_attempts`` attempts the last exception
    propagates unchanged; the caller translates it.
    """

    def _log_retry(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(event, attempt=state.attempt_number, error=repr(exc), **fields)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(transient),
        stop=tenacity.stop_after_attempt(policy.etcd_attempts),
        wait=tenacity.wait_exponential_jitter(
            multiplier=policy.etcd_backoff_initial_s,
            max=policy.etcd_backoff_max_s,
            jitter=policy.etcd_backoff_initial_s,  # tenacity's default jitter (1 s) would dwarf the backoff
        ),
        before_sleep=_log_retry,
        reraise=True,
    )
    return retrying(fn)
