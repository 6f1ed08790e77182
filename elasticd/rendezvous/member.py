"""What a member is and what it got: ``Joined`` (a rendezvous' outcome), ``MemberState``, and
``new_member_id``. Pure data."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from enum import StrEnum

from elasticd.wire.records import GenerationRecord


@dataclass(frozen=True)
class Joined:
    """The outcome of a rendezvous, from this member's point of view."""

    record: GenerationRecord
    rank: int
    duration_s: float
    excused_s: float = 0.0  # time not counted against the join deadline (etcd down, standby)

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def world_size(self) -> int:
        return self.record.world_size


class MemberState(StrEnum):
    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    CLOSED = "closed"


_incarnations = itertools.count()


def new_member_id(node: str, local_rank: int) -> str:
    """A member id unique per incarnation: node, local rank, pid, and a counter when one process
    joins more than once (a member that left must come back as a newcomer, never as its old self)."""
    n = next(_incarnations)
    return f"{node}.{local_rank}.{os.getpid()}" + (f".{n}" if n else "")
