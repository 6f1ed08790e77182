"""The random generators' states that travel and persist with the training state.

Owns ``DeviceRng`` (the seam to the accelerators' generators), ``CudaRng`` (CUDA's), and how the
RNG states sit past the state bytes of an arena: the CPU generator's, then each device's
(``rng_states``, ``split_rng_states``). Never decides what else is in an arena (``state`` does),
and the RNG states are no part of the state checksum (``checksum``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch


class DeviceRng(Protocol):
    """The random generators of a worker's accelerators, beside torch's CPU generator."""

    def states(self) -> list[torch.Tensor]:
        """One uint8 CPU tensor per device (none without devices)."""
        ...

    def load(self, states: Sequence[torch.Tensor]) -> None:
        """Set the generators from a peer's ``states()``."""
        ...


class CudaRng:
    """CUDA's generators, one per visible device (``torch.cuda.get_rng_state_all``).

    Read only in a process that has initialized CUDA: reading would create a context on every
    visible device (hundreds of MB each) just to send a seed state nothing drew from. Loaded
    wherever CUDA is available (torch defers it until CUDA starts). The sender's devices beyond
    this process's are ignored, and this process's beyond the sender's keep their state.
    """

    def states(self) -> list[torch.Tensor]:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
            return []
        return [s.cpu() for s in torch.cuda.get_rng_state_all()]

    def load(self, states: Sequence[torch.Tensor]) -> None:
        if not states or not torch.cuda.is_available():
            return
        for i in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[i], i)


def rng_states(device_rng: DeviceRng) -> list[torch.Tensor]:
    """The CPU generator's state, then each device's, as they go into an arena."""
    return [torch.get_rng_state(), *device_rng.states()]


def split_rng_states(
    layout: Mapping[str, object], flat: torch.Tensor, total: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU generator's state and each device's (copies), from past ``total`` in ``flat``.

    Raises:
        ValueError: the layout's sizes are malformed or do not add up to the buffer's end.
    """
    sizes = layout.get("cuda_rng", [])  # none in checkpoints written before CUDA's RNG travelled
    if not isinstance(sizes, list) or not all(type(n) is int and n > 0 for n in sizes):
        raise ValueError(f"cuda_rng sizes {sizes!r}")
    n_cpu = torch.get_rng_state().numel()
    if flat.numel() != total + n_cpu + sum(sizes):
        raise ValueError(f"RNG state of {flat.numel() - total} bytes, not {n_cpu} (CPU) + {sum(sizes)} (CUDA)")
    cpu = flat[total : total + n_cpu].clone()
    devices, at = [], total + n_cpu
    for n in sizes:
        devices.append(flat[at : at + n].clone())
        at += n
    return cpu, devices
