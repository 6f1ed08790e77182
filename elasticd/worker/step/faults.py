"""Fault injection at the step's edges: a test-only seam around the gradient reducer.

Owns ``Injected`` (the faults a worker was told to inject: ``WorkerEnv``'s ``stop_after_sum``,
``miss_sum_at`` and ``kill_after_apply``, each once) and ``FaultyReducer``, which wraps a
``GradientReducer`` and injects them at ``begin`` and ``finish``. The trainer wraps its reducer only
when a fault is asked for, so the step path itself holds no branch for them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elasticd.config import WorkerEnv
from elasticd.errors import CollectiveError
from elasticd.retry import Bound
from elasticd.worker.step.reducer import GradientReducer
from elasticd.worker.group.process_group import Group

MISSED_SUM_WAIT_S = 0.3  # miss_sum_at: how long the member waits for the sum before it fails the step


@dataclass
class Injected:
    """Faults to inject, each at one step, once (0: never)."""

    stop_after_sum: int = 0  # SIGSTOP itself once the sum arrived, before it applies the step
    miss_sum_at: int = 0  # drop the sum that arrived and fail the step (its last hop broke here alone)
    kill_after_apply: int = 0  # SIGKILL itself as it begins the step after this one (applied, unconfirmed)

    @classmethod
    def of(cls, env: WorkerEnv) -> Injected:
        return cls(env.stop_after_sum, env.miss_sum_at, env.kill_after_apply)

    def any(self) -> bool:
        return bool(self.stop_after_sum or self.miss_sum_at or self.kill_after_apply)


class FaultyReducer:
    """A ``GradientReducer`` that injects ``Injected``'s faults; everything else is the reducer's."""

    def __init__(self, reducer: GradientReducer, injected: Injected) -> None:
        self._reducer, self._injected = reducer, injected
        self._step = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._reducer, name)

    def begin(
        self, group: Group, step: int, scale: float, vote: Callable[[], Sequence[float]], sync: bool = True
    ) -> None:
        inj = self._injected
        if inj.kill_after_apply and step == inj.kill_after_apply + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # it applied the step before: applied, unconfirmed
        self._step = step
        self._reducer.begin(group, step, scale, vote, sync)

    def finish(self, bound: Bound) -> list[float]:
        summed = self._reducer.finish(bound)
        inj = self._injected
        if self._step == inj.miss_sum_at:  # this member's last hop broke, once
            inj.miss_sum_at = 0
            self._reducer.cancel()
            time.sleep(MISSED_SUM_WAIT_S)  # it waits for a sum that does not come; its peers go on
            raise CollectiveError(f"the sum of step {self._step} dropped here (fault injection: miss_sum_at)")
        if self._step == inj.stop_after_sum:  # a stop between the sum and the step's application, once
            inj.stop_after_sum = 0
            os.kill(os.getpid(), signal.SIGSTOP)
        return summed


def injecting(reducer: GradientReducer, env: WorkerEnv) -> GradientReducer:
    """``reducer``, wrapped when ``env`` asks for a fault."""
    injected = Injected.of(env)
    return FaultyReducer(reducer, injected) if injected.any() else reducer  # type: ignore[return-value]
