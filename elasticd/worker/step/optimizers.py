"""Stepping a trainer's optimizers at a commit: several optimizers, a gradient scaler, linear scaling.

Owns ``Optimizers``: the optimizers of one trainer (the first is the one ``TrainingState`` keeps;
the others are registered state), the optional ``torch.amp.GradScaler`` they step through, and the
``linear_scaling`` factor (``world_size / reference_world_size``) that multiplies every learning
rate for the optimizer step only, so schedulers and the synced state keep the unscaled rates; each
change of the factor is logged. Never decides whether a step is applied (``commit`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)


class Optimizers:
    """The optimizers stepped at a commit."""

    def __init__(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], scaler: Any = None) -> None:
        """
        Raises:
            ConfigError: not an optimizer or a non-empty sequence of them; a scaler without
                ``step``/``update``/``unscale_``.
        """
        items: list[torch.optim.Optimizer] = (
            [optimizer]
            if isinstance(optimizer, torch.optim.Optimizer)
            else list(optimizer)
            if isinstance(optimizer, Sequence)
            else []
        )
        if not items or not all(isinstance(o, torch.optim.Optimizer) for o in items):
            raise ConfigError("optimizer: a torch.optim.Optimizer or a non-empty sequence of them")
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("step", "update", "unscale_")):
            raise ConfigError(f"scaler: a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.all = items
        self.scaler = scaler
        self.factor = 1.0  # linear_scaling: every learning rate times this at a step

    def step(self, factor: float | None = None) -> None:
        """Every optimizer steps (through the scaler, then its ``update``), with the learning
        rates times ``factor`` (default: ``self.factor``) for this step only."""
        factor = self.factor if factor is None else factor
        saved = [[g["lr"] for g in o.param_groups] for o in self.all] if factor != 1.0 else []
        for o in self.all if saved else ():
            for g in o.param_groups:
                g["lr"] = g["lr"] * factor
        try:
            for o in self.all:
                if self.scaler is not None:
                    self.scaler.step(o)
                else:
                    o.step()
            if self.scaler is not None:
                self.scaler.update()
        finally:
            for o, lrs in zip(self.all, saved, strict=False):
                for g, lr in zip(o.param_groups, lrs, strict=True):
                    g["lr"] = lr

    def skip(self) -> None:
        """A step that is not applied: the scaler forgets an ``unscale_`` of it (as its ``update``
        would, without changing the scale), so the retried step can unscale again."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if states is not None:
            states.clear()  # a defaultdict: the next unscale_ starts from a fresh per-optimizer state

    def rescale(self, world_size: int, reference_world_size: int, generation: int) -> None:
        """Set the linear-scaling factor for ``world_size``; log it when it changed."""
        factor = world_size / reference_world_size
        if factor != self.factor:
            self.factor = factor
            log.info(
                "lr_scaled",
                generation=generation,
                world_size=world_size,
                reference_world_size=reference_world_size,
                factor=round(factor, 6),
                lrs=[round(g["lr"] * factor, 8) for o in self.all for g in o.param_groups],
            )
