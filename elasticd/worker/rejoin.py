"""Bringing one member into the newest generation: rendezvous, the in-process group, the state sync.

Owns ``connect`` (a worker's store client, group factory and registered membership), ``goodbye``
(the last barrier of members that finished together) and ``rejoin``: it asks the membership for the next generation (``Membership.join``, which may
resume the job from a durable checkpoint through ``resume``), builds that generation's group in this
process, and has rank 0 sync its state to the members that lack it (``sync_state``); a failure in
the group build or the sync aborts that generation and tries the next, until the join deadline.
Never decides membership (``rendezvous`` does), never applies a step (the trainer does), and never
changes what the state holds (``state`` does).
"""

from __future__ import annotations

import dataclasses

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from elasticd.config import Timeouts, WorkerEnv
from elasticd.errors import CheckpointTransferError, CollectiveError
from elasticd.log import set_moment
from elasticd.rendezvous.member import Joined, new_member_id
from elasticd.rendezvous.membership import Membership
from elasticd.relay.store import RelayedStore
from elasticd.retry import Bound, Deadline
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord
from elasticd.worker.group.collectives import barrier
from elasticd.worker.group.process_group import Group, GroupFactory, StoreServer
from elasticd.worker.state.training import ChecksumAhead, TrainingState
from elasticd.worker.state.sync import Discard, SyncReport, sync_state

log = structlog.get_logger(__name__)

# Lineages of state loaded from disk (DISK_LINEAGE_BASE + the checkpoint's seq): above any
# generation number, so they never match the lineage of live state.
DISK_LINEAGE_BASE = 1 << 48


@dataclass(frozen=True)
class Rejoined:
    group: Group
    joined: Joined
    report: SyncReport


def etcd_client(env: WorkerEnv, attempts: int | None = None) -> KeyValueStore:
    """An etcd client for ``env.etcd`` (the worker's default store), with ``attempts`` per call
    instead of ``env.retry``'s when given.

    Raises:
        EtcdUnavailable: with a user, connecting authenticates, and etcd did not answer.
    """
    from elasticd.store.etcd import EtcdClient  # an etcd client only where none was given

    retry = env.retry if attempts is None else dataclasses.replace(env.retry, etcd_attempts=attempts)
    return EtcdClient(env.etcd, env.timeouts, retry)


def connect(
    env: WorkerEnv, signature: str, store: KeyValueStore | None
) -> tuple[KeyValueStore, GroupFactory, Membership]:
    """This worker's store client (an etcd client for ``env.etcd`` unless given), its c10d store
    server and group factory, and its registered membership (its background threads started).

    Raises:
        EtcdUnavailable: etcd could not be reached within the retry bound.
    """
    if store is None:
        store = etcd_client(env)
    keys = Keys(env.etcd.prefix, env.world.job_id)
    if env.relay_socket:  # the view and watches from the node's relay (relay.node)
        store = RelayedStore(store, keys, env.relay_socket, env.timeouts, env.retry)
    server = StoreServer(env.advertise_addr, env.timeouts)
    factory = GroupFactory(server, env.advertise_addr, env.backend, env.local_rank, env.timeouts)
    record = MemberRecord(
        member_id=new_member_id(env.node_id, env.local_rank),
        node=env.node_id,
        local_rank=env.local_rank,
        pid=os.getpid(),
        host=env.advertise_addr,
        store_port=server.port,
        signature=signature,
        spare=int(env.spare),
        standby=int(env.standby),
    )
    membership = Membership(store, keys, record, env.world, env.timeouts)
    set_moment(node=env.node_id, member=record.member_id)
    membership.start()
    return store, factory, membership


def rejoin(
    membership: Membership,
    factory: GroupFactory,
    state: TrainingState,
    timeouts: Timeouts,
    *,
    has_state: Callable[[], bool],
    disk_seq: Callable[[], int | None],
    resume: Callable[[int], int] | None,
    discard: Discard | None = None,
) -> Rejoined:
    """Join the newest generation and hold rank 0's state in its new group.

    Args:
        membership: this member's rendezvous.
        factory: builds the generation's group (and the subgroups of a transfer).
        state: this member's state (its step and lineage say what it holds).
        timeouts: the join, group-build and transfer bounds.
        has_state: whether this member holds state now (a resume during the rendezvous loads some).
        disk_seq: the seq of the checkpoint this member's state was loaded from, if it was.
        resume: loads the newest checkpoint when no live member holds state (None: no directory).
        discard: told when the sync replaces this member's state with one of another lineage (its
            unconfirmed steps are a branch the job left).

    Raises:
        CollectiveError, CheckpointTransferError: the join deadline passed with no generation joined.
        JobFinished: the job's last step was already committed.
    """
    deadline = Deadline.after(timeouts.join_s)

    def bound(span_s: float) -> Bound:  # a wait in the generation being joined
        return Bound.after(span_s, poll_s=timeouts.abort_poll_s, abandon=membership.must_abandon)

    # Hash our state while we rendezvous (nothing changes it until the sync): rank 0 and the
    # survivors that receive nothing then have their checksum ready when the transfer starts.
    ahead = ChecksumAhead(state) if has_state() else None
    while True:
        committed = state.counters.step if has_state() else -1
        joined = membership.join(committed, deadline, resume=resume)
        # Time the rendezvous spent waiting for etcd or as a standby did not count against it.
        deadline = Deadline(deadline.at + joined.excused_s, deadline.clock)
        rec = joined.record
        set_moment(generation=rec.generation, rank=joined.rank)
        group: Group | None = None
        try:
            group = factory.build(
                rec.generation,
                joined.rank,
                rec.world_size,
                rec.store_host,
                rec.store_port,
                bound(min(timeouts.group_build_s, deadline.remaining_s())),
                token=rec.token,
            )
            # Members that all loaded the same checkpoint hold one lineage (its seq names it).
            seq = disk_seq()
            if seq is not None and state.lineage < 0:
                state.lineage = DISK_LINEAGE_BASE + seq
            if not has_state():
                state.lineage = -1
            sync = bound(timeouts.checkpoint_transfer_s)
            own = ahead.result(sync.deadline) if ahead is not None else None
            ahead = None  # a failed attempt may have changed the state: a retry hashes it anew

            def subgroup(parent: Group, ranks: Sequence[int], name: str) -> Group:
                return factory.build_subgroup(parent, ranks, name, bound(timeouts.group_build_s))

            report = sync_state(
                group, state, sync, subgroup=subgroup, retire=factory.retire, own_checksum=own, discard=discard
            )
            return Rejoined(group, joined, report)
        except (CollectiveError, CheckpointTransferError) as exc:
            log.warning("generation_join_failed", generation=rec.generation, rank=joined.rank, error=str(exc)[:300])
            membership.abort(rec.generation, str(exc))
            factory.retire(group)
            if deadline.expired():
                raise


def goodbye(group: Group | None, membership: Membership, timeouts: Timeouts, step: int) -> bool:
    """Every member stopped at the same last step: a barrier, the commit point of the last step
    (no later all_reduce confirms it), then the ``finished`` record, written by every member whose
    barrier completed (a member that missed the barrier's last hop reads it at its rejoin). False
    when the barrier did not complete (or the generation is abandoned): the last step is not
    confirmed, and the member must rejoin holding it."""
    if group is None or membership.must_abandon():
        return False
    bound = Bound.after(timeouts.collective_s, poll_s=timeouts.abort_poll_s, abandon=membership.must_abandon)
    try:
        barrier(group, bound)
    except CollectiveError as exc:
        log.warning("goodbye_barrier_failed", generation=group.generation, rank=group.rank, error=str(exc)[:300])
        return False
    membership.mark_finished(group.generation, step)
    return True
