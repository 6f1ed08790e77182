"""What a member is and what it got: ``Joined`` (a rendezvous' outcome), ``Standing`` (its own
standing, for the commit fence), ``MemberState``, and ``new_member_id``. Pure data."""

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


@dataclass(frozen=True)
class Standing:
    """One member's own standing (monotonic seconds)."""

    fenced: bool  # its generation was superseded or aborted (seen in etcd)
    lease_lost: bool  # etcd said its lease is gone
    renewed_at: float  # when it last asked for a renewal that etcd granted
    lease_ttl_s: float  # the TTL etcd granted (at least etcd's minimum)
    continued: bool  # stopped and continued since that renewal was asked (continued.py)
    grants: int = 0  # renewals etcd granted so far (Lease.grants): a later one proves the lease alive
    lease: int = 0  # the lease they were granted for


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
