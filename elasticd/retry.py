"""``Deadline`` (monotonic), ``Bound`` (one bounded wait) and the named tenacity retry policies.

Owns how elasticd waits and retries. It knows nothing about etcd or torch: callers pass in which
exception types are transient.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TypeVar

import structlog
import tenacity

from elasticd.config import RetryPolicy

log = structlog.get_logger(__name__)

Clock = Callable[[], float]
Abandon = Callable[[], bool]  # true once a wait should end early (its generation was abandoned)
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


def never() -> bool:
    """The abandon signal of a wait that nothing abandons."""
    return False


@dataclass(frozen=True)
class Bound:
    """One bounded wait, handed whole to every callee that waits under it.

    A wait under a bound ends at ``deadline`` (a timeout), or early once ``abandon()`` is true (the
    generation was abandoned, or the caller gave up); a waiter that nothing wakes looks at both
    every ``poll_s`` seconds (``Timeouts.abort_poll_s``). A bound limits how long survivors wait,
    never what the wait's outcome means.
    """

    deadline: Deadline
    poll_s: float
    abandon: Abandon = never

    @classmethod
    def after(
        cls, span: timedelta | float, *, poll_s: float, abandon: Abandon = never, clock: Clock = time.monotonic
    ) -> Bound:
        """A bound that ends ``span`` (seconds, or a timedelta) from now."""
        return cls(Deadline.after(span, clock), poll_s, abandon)

    def abandoned(self) -> bool:
        return self.abandon()

    def expired(self) -> bool:
        return self.deadline.expired()

    def remaining_s(self) -> float:
        return self.deadline.remaining_s()

    def abandoned_also_when(self, signal: Abandon) -> Bound:
        """This bound, abandoned as well once ``signal()`` is true (checked first)."""
        own = self.abandon
        return replace(self, abandon=lambda: signal() or own())


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
