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
from elasticd.errors import CheckpointTransferError, CollectiveError, ReplicaBroken
from elasticd.log import set_moment
from elasticd.rendezvous.answer import Answerer
from elasticd.rendezvous.member import Joined, new_member_id
from elasticd.rendezvous.membership import Membership
from elasticd.relay.store import RelayedStore
from elasticd.retry import Bound, Deadline
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord
from elasticd.worker.group.process_group import Group, GroupFactory, StoreServer
from elasticd.worker.shard.replica import Replica
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
    shard_group: Group | None = None  # sharded training: this rank's shard index across the replicas


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
    answerer = Answerer(env.advertise_addr) if env.timeouts.unresponsive_s > 0 else None
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
        replica=env.replica if env.replica_size > 1 else "",
        shard=env.shard,
        replica_size=env.replica_size,
        answer_port=answerer.port if answerer is not None else 0,
    )
    membership = Membership(store, keys, record, env.world, env.timeouts, answerer=answerer)
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
    replica: Replica | None = None,
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
        replica: sharded training: this rank's replica (its shard of the state syncs over its
            shard group, and the replica's ranks agree on the outcome: ``_sync``).

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
        membership.reach.began(rec.generation, build=True)  # a member cut off or hung meanwhile: asked
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

            shards, report = _sync(factory, group, state, sync, bound, timeouts, replica, own, discard)
            return Rejoined(group, joined, report, shards)
        except (CollectiveError, CheckpointTransferError) as exc:
            log.warning("generation_join_failed", generation=rec.generation, rank=joined.rank, error=str(exc)[:300])
            membership.abort(rec.generation, str(exc))
            factory.retire(group)
            if deadline.expired():
                raise
        finally:
            membership.reach.ended()


def _sync(
    factory: GroupFactory,
    group: Group,
    state: TrainingState,
    sync: Bound,
    bound: Callable[[float], Bound],
    timeouts: Timeouts,
    replica: Replica | None,
    own: int | None,
    discard: Discard | None,
) -> tuple[Group | None, SyncReport]:
    """Rank 0's state to every rank of ``group`` that lacks it (``sync_state``). With a replica:
    over this rank's shard group (built here, retired here if the sync fails), each shard's state
    from rank 0's replica's rank of that shard; then the replica's ranks agree that every shard
    synced (``_replica_synced``), once per generation, whatever happened here.

    Raises:
        CollectiveError, CheckpointTransferError: the sync failed here, or on a rank of the replica.
        ReplicaBroken: the replica's ranks no longer hold one state.
    """
    prefix = f"shard-{replica.shard}/" if replica is not None else ""  # a transfer's subgroups, per shard group

    def subgroup(parent: Group, ranks: Sequence[int], name: str) -> Group:
        return factory.build_subgroup(parent, ranks, prefix + name, bound(timeouts.group_build_s))

    if replica is None:
        return None, sync_state(group, state, sync, subgroup, factory.retire, own, discard)
    loads, shards = state.loads, None
    try:
        shards = _shard_group(factory, group, replica, bound(timeouts.group_build_s))
        report = sync_state(shards, state, sync, subgroup, factory.retire, own, discard)
    except (CollectiveError, CheckpointTransferError):
        _replica_synced(replica, group.generation, False, state.loads != loads, bound(timeouts.collective_s))
        factory.retire(shards)
        raise
    except BaseException:
        factory.retire(shards)
        raise
    if not _replica_synced(replica, group.generation, True, state.loads != loads, sync):
        factory.retire(shards)
        raise CheckpointTransferError(
            f"generation {group.generation}: another shard of replica {replica.id} did not sync"
        )
    return shards, report


def _shard_group(factory: GroupFactory, group: Group, replica: Replica, bound: Bound) -> Group:
    """This rank's shard group of ``group``: rank ``replica.shard`` of every replica.

    Raises:
        CollectiveError: the generation's ranks are not whole replicas of this one's size in shard
            order (this rank's place says another shard), or the group was not built.
    """
    k = replica.size
    if group.world_size % k or group.rank % k != replica.shard:
        raise CollectiveError(
            f"generation {group.generation}: rank {group.rank} of {group.world_size} is not shard "
            f"{replica.shard} of a replica of {k}: every member of a sharded job must run with the same replica_size"
        )
    ranks = [r * k + replica.shard for r in range(group.world_size // k)]
    return factory.build_subgroup(group, ranks, f"shard-{replica.shard}", bound)


def _replica_synced(replica: Replica, generation: int, ok: bool, replaced: bool, bound: Bound) -> bool:
    """Whether every shard of the replica synced ``generation``: its ranks say so over the replica's
    store, keyed by the generation (they need not be in step). False: a shard did not sync (or did
    not say within ``bound``), and every rank of the replica kept its state, or every one took rank
    0's (one that took it and cannot tell the others' raises).

    Raises:
        ReplicaBroken: some of the replica's ranks took rank 0's state and some did not (or one
            that took it cannot tell): its shards no longer make one state.
    """
    outcome = replica.outcome(f"sync/{generation}", (int(ok), int(replaced)), bound)
    if outcome is not None and all(o == 1 for o, _ in outcome):
        return True
    took = sum(r for _, r in outcome) if outcome is not None else int(replaced)
    if 0 < took < replica.size or (outcome is None and replaced):
        raise ReplicaBroken(
            f"generation {generation}: some shards of replica {replica.id} took rank 0's state and some did not"
        )
    return False


def goodbye(
    group: Group | None,
    membership: Membership,
    timeouts: Timeouts,
    step: int,
    collective: Callable[[Group, Bound], None],
) -> bool:
    """Every member stopped at the same last step: a barrier, the commit point of the last step
    (no later all_reduce confirms it), then the ``finished`` record, written by every member whose
    barrier completed (a member that missed the barrier's last hop reads it at its rejoin). False
    when the barrier did not complete (or the generation is abandoned): the last step is not
    confirmed, and the member must rejoin holding it. ``collective``: the barrier
    (``ElasticTrainer._goodbye``; the drop-in form's has its step's shape)."""
    if group is None or membership.must_abandon():
        return False
    bound = Bound.after(timeouts.collective_s, poll_s=timeouts.abort_poll_s, abandon=membership.must_abandon)
    try:
        collective(group, bound)
    except CollectiveError as exc:
        log.warning("goodbye_barrier_failed", generation=group.generation, rank=group.rank, error=str(exc)[:300])
        return False
    membership.mark_finished(group.generation, step)
    return True
