"""Bounded collectives on a generation's group.

Owns every collective call made on a generation's group (the gradient reducer's buckets go out
through the group directly, and are waited for with ``wait``): each wait runs under a
``retry.Bound``, ends at its deadline and checks, every ``poll_s``, whether the generation was
abandoned (a peer lost its lease), so a peer frozen with SIGSTOP cannot hold the survivors;
point-to-point sends and receives are waited for with the same bounds (``wait_each``). torch errors
become ``CollectiveError``. Never retries in place: a failed collective latches the failure and the
caller re-rendezvouses.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticd.errors import CollectiveError, CollectiveTimeout, PeerLost
from elasticd.retry import Bound
from elasticd.worker.group.process_group import Group


def wait(work: dist.Work, group: Group, bound: Bound, what: str) -> None:
    """Wait for ``work`` without ever blocking past ``bound``'s deadline or an abandoned generation.

    Raises:
        CollectiveError: the collective failed (e.g. a peer crashed and closed its sockets).
        PeerLost: the generation was abandoned while waiting.
        CollectiveTimeout: ``bound``'s deadline passed.
    """
    if group.backend == "nccl":
        while not work.is_completed():
            _check(group, bound, what)
            time.sleep(bound.poll_s / 10)
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveError(f"{what} failed in generation {group.generation}: {exc}") from exc
        return
    slice_ = timedelta(seconds=bound.poll_s)
    while True:
        try:
            work.wait(slice_)
            return
        except RuntimeError:
            if work.is_completed():
                # Done, but maybe only just after the slice ran out: a second wait tells success
                # (returns at once) from failure (raises the collective's own error).
                try:
                    work.wait(slice_)
                    return
                except RuntimeError as exc:
                    raise CollectiveError(f"{what} failed in generation {group.generation}: {exc}") from exc
        _check(group, bound, what)


def _check(group: Group, bound: Bound, what: str) -> None:
    if bound.abandoned():
        raise PeerLost(f"{what} abandoned: generation {group.generation} lost a member")
    if bound.expired():
        raise CollectiveTimeout(f"{what} timed out in generation {group.generation}")


def _launch(fn: Callable[[], dist.Work], group: Group, what: str) -> dist.Work:
    try:
        return fn()
    except RuntimeError as exc:
        raise CollectiveError(f"{what} could not start in generation {group.generation}: {exc}") from exc


def all_reduce(tensor: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType, bound: Bound) -> None:
    """In-place bounded all_reduce.

    Raises:
        CollectiveError: see ``wait`` (``PeerLost``, ``CollectiveTimeout`` are subclasses).
    """
    opts = dist.AllreduceOptions()
    opts.reduceOp = op  # type: ignore[assignment]  # the stubs disagree with the binding
    work = _launch(lambda: group.pg.allreduce([tensor], opts), group, "all_reduce")
    wait(work, group, bound, "all_reduce")


def barrier(group: Group, bound: Bound) -> None:
    """A bounded barrier: a one-element all_reduce every rank must reach.

    Raises:
        CollectiveError: see ``wait``.
    """
    all_reduce(torch.zeros(1, device=group.device), group, dist.ReduceOp.SUM, bound)


def start_broadcast(tensor: torch.Tensor, root: int, group: Group) -> dist.Work:
    """Launch an in-place broadcast from ``root``; finish it with ``wait``.

    Raises:
        CollectiveError: the group refused to start it.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return _launch(lambda: group.pg.broadcast([tensor], opts), group, "broadcast")


def start_send(tensor: torch.Tensor, dst: int, group: Group, tag: int) -> dist.Work:
    """Launch a point-to-point send of ``tensor`` to rank ``dst``; finish it with ``wait_each``.

    Raises:
        CollectiveError: the group refused to start it.
    """
    return _launch(lambda: group.pg.send([tensor], dst, tag), group, "send")


def start_recv(tensor: torch.Tensor, src: int, group: Group, tag: int) -> dist.Work:
    """Launch a point-to-point receive into ``tensor`` from rank ``src``; finish it with ``wait_each``.

    Raises:
        CollectiveError: the group refused to start it.
    """
    return _launch(lambda: group.pg.recv([tensor], src, tag), group, "recv")


def wait_each(works: Sequence[dist.Work], group: Group, bound: Bound, what: str) -> Iterator[int]:
    """Wait for ``works`` in order, yielding each one's index once it completed, with the bounds of
    ``wait``. Use it for point-to-point works (``start_send``/``start_recv``).

    gloo cannot bound a send or receive in slices as ``wait`` does: a timed-out ``wait(timeout)``
    on one signals an "application timeout" to every pair of the group, which breaks it. So on
    gloo a daemon thread makes the unbounded waits (gloo's own context timeout, ``collective_s``,
    still ends them, and a crashed peer ends them at once) while the caller polls it; if the caller
    gives up, the thread holds only the works and ends with them.

    Raises:
        CollectiveError, PeerLost, CollectiveTimeout: as ``wait``.
    """
    if group.backend != "gloo":
        for i, work in enumerate(works):
            wait(work, group, bound, what)
            yield i
        return
    done: queue.SimpleQueue[int | RuntimeError] = queue.SimpleQueue()
    threading.Thread(target=_wait_in_order, args=(list(works), done), name="elasticd-p2p-wait", daemon=True).start()
    for _ in works:
        while True:
            try:
                item = done.get(timeout=bound.poll_s)
                break
            except queue.Empty:
                _check(group, bound, what)
        if isinstance(item, RuntimeError):
            raise CollectiveError(f"{what} failed in generation {group.generation}: {item}") from item
        yield item


def _wait_in_order(works: list[dist.Work], done: queue.SimpleQueue[int | RuntimeError]) -> None:
    for i, work in enumerate(works):
        try:
            work.wait()
        except RuntimeError as exc:
            done.put(exc)
            return
        done.put(i)
