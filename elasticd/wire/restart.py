"""The records restart mode keeps in etcd, and their tolerant parsing (``agent/restart.py``).

Owns the JSON records under ``<prefix>/<job>/restart/`` (their key names are ``keys.Keys``'s
``restart_*``): the agents (leased), the nodes waiting for a round (leased), the current round, the
failed and finished marks and each node's done mark. ``parse_view`` turns the raw keys into a
``RoundView`` and lists malformed records instead of failing. Pure: no I/O, no torch, never names a
key itself; read by the restart-mode agent and by ``ops/status.py`` (so ``elasticctl status`` shows
restart-mode jobs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS, decode

# ---------------------------------------------------------------------------------------------
# Records (JSON in etcd; parsing never trusts them)


@dataclass(frozen=True)
class AgentRecord:
    """``agents/<node>`` (leased): this node's agent is alive."""

    node: str
    pid: int
    host: str


@dataclass(frozen=True)
class WaitingRecord:
    """``waiting/<node>`` (leased): the node wants into the next round."""

    node: str
    nproc: int
    host: str  # advertise_addr: MASTER_ADDR if this node becomes node rank 0
    port: int  # a free port on it, picked when this record was written: MASTER_PORT then
    last_round: int  # the last round this node ran in (0: none)


@dataclass(frozen=True)
class RoundRecord:
    """``round``: the current round of the job."""

    round: int
    nodes: tuple[str, ...]  # node rank order
    nproc_per_node: int
    master_addr: str
    master_port: int
    restart_count: int  # rounds before this one that ended by a failure (TORCHELASTIC_RESTART_COUNT)
    reason: str  # start, worker_failed, node_lost, node_left, join

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node


@dataclass(frozen=True)
class FailedRecord:
    """``failed``: the named round is over; every agent of it stops its workers and rejoins."""

    round: int
    node: str  # whose agent marked it
    cause: str  # a Cause
    detail: str


@dataclass(frozen=True)
class DoneRecord:
    """``done/<node>`` (not leased, so that a finished node may leave): every worker of the node
    exited 0 in ``round``."""

    node: str
    round: int


@dataclass(frozen=True)
class FinishedRecord:
    """``finished``: every node of ``round`` was done; the job is over."""

    round: int


class Cause(StrEnum):
    """Why a round ended."""

    WORKER_FAILED = "worker_failed"  # a worker exited non-zero, was killed, or could not start
    NODE_LOST = "node_lost"  # a node's agent lease is gone
    NODE_LEFT = "node_left"  # a node's agent was asked to stop (SIGTERM)
    JOIN = "join"  # a new node waits and fits: restart to take it in (torchrun does the same)


# Restarts for these causes count against max_restarts; joins and orderly leaves do not.
COUNTED_CAUSES = frozenset({Cause.WORKER_FAILED, Cause.NODE_LOST})


@dataclass(frozen=True)
class RoundView:
    """Everything under the restart prefix, parsed; malformed records are listed, not fatal."""

    round: RoundRecord | None = None
    round_revision: int = 0
    agents: Mapping[str, AgentRecord] = field(default_factory=dict)
    waiting: Mapping[str, WaitingRecord] = field(default_factory=dict)
    waiting_order: Mapping[str, int] = field(default_factory=dict)  # node -> create_revision
    failed: FailedRecord | None = None
    failed_revision: int = 0
    done: Mapping[str, int] = field(default_factory=dict)  # node -> round
    finished: int = 0  # the round that finished (0: none)
    malformed: tuple[str, ...] = ()

    @property
    def failed_round(self) -> int:
        return self.failed.round if self.failed is not None else 0

    @property
    def highest_round(self) -> int:
        return max(self.round.round if self.round else 0, self.failed_round, self.finished)


def parse_view(keys: Keys, kvs: Iterable[KeyValue]) -> RoundView:
    """Turn the raw keys under the restart prefix into a ``RoundView``; garbage goes to ``malformed``."""
    rnd: RoundRecord | None = None
    round_revision = 0
    agents: dict[str, AgentRecord] = {}
    waiting: dict[str, WaitingRecord] = {}
    order: dict[str, int] = {}
    failed: FailedRecord | None = None
    failed_revision = 0
    done: dict[str, int] = {}
    finished = 0
    malformed: list[str] = []
    for kv in kvs:
        try:
            if kv.key == keys.restart_round:
                round_revision = kv.mod_revision
                rnd = decode(RoundRecord, kv.value)
                if rnd.round < 1 or not rnd.nodes or len(set(rnd.nodes)) != len(rnd.nodes) or rnd.nproc_per_node < 1:
                    rnd = None
                    raise ValueError("round must be >= 1 with distinct, non-empty nodes and nproc_per_node >= 1")
            elif kv.key == keys.restart_failed:
                failed_revision = kv.mod_revision
                failed = decode(FailedRecord, kv.value)
            elif kv.key == keys.restart_finished:
                finished = decode(FinishedRecord, kv.value).round
            elif kv.key.startswith(keys.restart_agent("")):
                a = decode(AgentRecord, kv.value)
                if kv.key != keys.restart_agent(a.node):
                    raise ValueError("node does not match its key")
                agents[a.node] = a
            elif kv.key.startswith(keys.restart_waiting("")):
                w = decode(WaitingRecord, kv.value)
                if kv.key != keys.restart_waiting(w.node):
                    raise ValueError("node does not match its key")
                waiting[w.node] = w
                order[w.node] = kv.create_revision
            elif kv.key.startswith(keys.restart_done("")):
                d = decode(DoneRecord, kv.value)
                if kv.key != keys.restart_done(d.node):
                    raise ValueError("node does not match its key")
                done[d.node] = d.round
        except DECODE_ERRORS as exc:
            malformed.append(f"{kv.key}: {exc}")
    return RoundView(
        rnd, round_revision, agents, waiting, order, failed, failed_revision, done, finished, tuple(malformed)
    )
