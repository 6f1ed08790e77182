"""The NCCL path of a generation's group, in the order torch 2.13's c10d documents for fault tolerance.

Owns the sequence of torch calls that builds a NCCL group and the one that aborts it, with their
bounds. ``process_group.py`` owns the store, the arrival barrier and the gloo path, and hands NCCL
groups to this module. The torch calls sit behind ``NcclCalls``, so the sequence is tested without
a GPU (``tests/unit/test_nccl_sequence.py``); ``TorchNccl`` makes the real ones. Never retries,
never decides membership, never destroys a communicator.

* Before the first group: NCCL's environment (``settings.nccl_environ``), set as defaults (an
  operator's value wins; the elastic agent passes the same defaults to its workers). From torch
  2.13's ``ProcessGroupNCCL.hpp``/``.cpp`` and ``NCCLUtils.cpp``:

  - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (``CleanUpOnly``): on a failed or timed-out collective
    the watchdog aborts the communicators and does not tear the process down. The default, 3
    (``SkipCleanUp``), and 1 (``TearDown``) kill the process; 0 leaves a hung kernel running.
  - ``TORCH_NCCL_BLOCKING_WAIT=0``: with 1, ``Work.wait`` blocks the CPU and no watchdog thread
    is made; elasticd polls ``is_completed()`` against its own deadline and abandon flag.
  - ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: otherwise, after a timeout here, or a dump flag that any
    rank left in the TCPStore (which every generation shares), the first group's heartbeat
    monitor writes the flight recorder to local disk (up to 2 x 15 s) and stops watching; with
    monitoring on, it then ends the process unless that group was aborted meanwhile.
  - ``TORCH_NCCL_ENABLE_MONITORING=0``: otherwise a watchdog without a heartbeat for
    ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (8 min) ends in ``std::abort`` of the whole process, for
    instance an old generation's watchdog stuck in ``ncclCommAbort`` while a newer group trains.
    The abort is bounded here instead (``group_abort_s``), with an exit code of elasticd's own.
  - ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (read once per process; default 30 min): bounds each wait
    of a non-blocking communicator (init, enqueue, ``ncclCommAbort``). Such a wait holds the
    communicator's lock, which ``abort()`` needs, so it is at most half of ``group_abort_s``;
    and at most ``group_build_s``, the bound on the init it serves.
* Build: the CUDA device is set; ``ProcessGroupNCCL.Options`` with ``config.blocking = 0``
  (non-blocking init, where this torch has the option); the backend, registered in a
  ``ProcessGroup`` bound to the device (``bound_device_id``), as ``_new_process_group_helper``
  does for ``init_process_group(device_id=...)``; ``eager_connect_single_device`` creates the
  communicator now, not at the first collective. A non-blocking communicator only reports that it
  is ready when it is next used, so a one-element all_reduce, polled against the build deadline,
  says that it is. A build that fails, or that its caller gave up on, is aborted on its thread.
* Retire: ``ProcessGroup.abort()`` (``ncclCommAbort`` on each communicator), never ``shutdown()``
  or ``destroy_process_group`` (they finalize and wait for kernels that wait for a dead peer;
  torch 2.13 no longer has ``TORCH_NCCL_ABORT_IN_DESTROY_PG``). The abort runs on a thread bounded
  by ``group_abort_s``: past it the worker logs ``process_group_abort_hung`` and exits with
  ``EXIT_GROUP_ABORT_HUNG``, so that its agent restarts it, because a hung abort would hang
  training (torch's own bound on abort does not hold: its ``std::async`` future waits for the
  stuck ``abortComms`` when it is destroyed).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Protocol

import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, ProcessGroup, Store

from elasticd.config import Timeouts
from elasticd.errors import CollectiveTimeout, PeerLost
from elasticd.retry import Bound
from elasticd.settings import environ_defaults, nccl_environ

log = structlog.get_logger(__name__)

# EX_TEMPFAIL: the agent restarts a worker that failed, and the new one rejoins as a newcomer.
EXIT_GROUP_ABORT_HUNG = 75


class Abortable(Protocol):
    def abort(self) -> None: ...


class Probe(Protocol):
    """The one-element all_reduce that tells when a non-blocking communicator is ready."""

    def is_completed(self) -> bool: ...

    def wait(self) -> bool: ...


class NcclCalls(Protocol):
    """The torch calls of the NCCL sequence, in the order ``NcclGroups`` makes them."""

    def set_device(self, device: torch.device) -> None: ...

    def new_backend(
        self, store: Store, rank: int, world_size: int, timeout: timedelta, nonblocking: bool
    ) -> tuple[Backend, bool]:
        """The backend, and whether its init is non-blocking (this torch may lack the option)."""
        ...

    def bind(
        self, backend: Backend, store: Store, rank: int, world_size: int, device: torch.device
    ) -> ProcessGroup: ...

    def eager_connect(self, backend: Backend, device: torch.device) -> None: ...

    def probe(self, pg: ProcessGroup, device: torch.device) -> Probe: ...

    def abort(self, target: Abortable) -> None: ...


class TorchNccl:
    """The real calls (a torch built with NCCL, and a GPU)."""

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def new_backend(
        self, store: Store, rank: int, world_size: int, timeout: timedelta, nonblocking: bool
    ) -> tuple[Backend, bool]:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False  # _new_process_group_helper's default
        opts.global_ranks_in_group = list(range(world_size))
        applied = nonblocking and request_nonblocking_init(opts)
        backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        return backend, applied

    def bind(self, backend: Backend, store: Store, rank: int, world_size: int, device: torch.device) -> ProcessGroup:
        pg = ProcessGroup(store, rank, world_size)
        pg.bound_device_id = device  # first: registering hands it to the backend (setBoundDeviceId)
        pg._set_default_backend(ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, backend)
        return pg

    def eager_connect(self, backend: Backend, device: torch.device) -> None:
        backend.eager_connect_single_device(device)

    def probe(self, pg: ProcessGroup, device: torch.device) -> Probe:
        return pg.allreduce([torch.zeros(1, device=device)], dist.AllreduceOptions())

    def abort(self, target: Abortable) -> None:
        target.abort()


def request_nonblocking_init(opts: object) -> bool:
    """Set ``opts.config.blocking = 0`` (``ProcessGroupNCCL.Options``), if this torch has it.

    ``ProcessGroupNCCL::useNonblocking`` takes an explicit ``config.blocking`` first, before
    ``TORCH_NCCL_USE_COMM_NONBLOCKING``; a bound device no longer turns it on by itself (2.7.1 took
    that out, for a hang in NCCL 2.26). Returns whether it was set.
    """
    config = getattr(opts, "config", None)
    if config is None or not hasattr(config, "blocking"):
        return False
    config.blocking = 0
    return True


def exit_hard() -> None:
    """Leave now, without atexit handlers or destructors: they would wait for the hung abort."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe must not keep the process alive
            pass
    os._exit(EXIT_GROUP_ABORT_HUNG)


class NcclGroups:
    """Builds and aborts the NCCL groups of one worker, on one device.

    Args:
        calls: the torch calls (``TorchNccl()``; tests pass a recording fake).
        device: the worker's CUDA device.
        timeouts: ``group_abort_s`` bounds an abort, ``collective_s`` is the backend's own
            timeout (a build's bound, with its ``poll_s``, is the caller's).
        environ: sets the environment's defaults and returns the values in effect
            (``settings.environ_defaults``).
        on_abort_hung: called, after the log line, when an abort outlives ``group_abort_s``
            (``exit_hard``; it does not return).
    """

    def __init__(
        self,
        calls: NcclCalls,
        device: torch.device,
        timeouts: Timeouts,
        *,
        environ: Callable[[Mapping[str, str]], Mapping[str, str]] = environ_defaults,
        on_abort_hung: Callable[[], None] = exit_hard,
    ) -> None:
        self._calls, self.device, self._timeouts, self._on_abort_hung = calls, device, timeouts, on_abort_hung
        # Before any group: the watchdog reads these when a backend is constructed, and
        # TORCH_NCCL_NONBLOCKING_TIMEOUT once per process.
        self.environ = dict(environ(nccl_environ(timeouts)))
        log.debug("nccl_environment_set", **{k.lower(): v for k, v in self.environ.items()})
        calls.set_device(device)
        self._builds = threading.Condition()
        self._building = 0  # builds under way, including given-up ones not yet aborted

    def build(self, store: Store, rank: int, world_size: int, bound: Bound, what: str) -> ProcessGroup:
        """Build a group whose communicator is ready, on the calling (helper) thread.

        Waits first for an earlier build that its caller gave up on to be aborted, so that no
        communicator is created on the device while another one is being aborted.

        Raises:
            PeerLost: ``bound`` was abandoned (the caller gave up, or the generation was
                abandoned); whatever was built is aborted.
            CollectiveTimeout: ``bound``'s deadline passed; whatever was built is aborted.
            RuntimeError: a torch call failed (``DistBackendError`` included); whatever was built
                is aborted.
        """
        with self._builds:
            while self._building:
                self._check(bound, f"{what}: an earlier build (given up) has not been aborted yet")
                self._builds.wait(min(bound.poll_s, bound.remaining_s()))
            self._building += 1
        try:
            return self._build(store, rank, world_size, bound, what)
        finally:
            with self._builds:
                self._building -= 1
                self._builds.notify_all()

    def _build(self, store: Store, rank: int, world_size: int, bound: Bound, what: str) -> ProcessGroup:
        backend, nonblocking = self._calls.new_backend(
            store, rank, world_size, timedelta(seconds=self._timeouts.collective_s), nonblocking=True
        )
        target: Abortable = backend
        ready = False
        try:
            pg = self._calls.bind(backend, store, rank, world_size, self.device)
            target = pg
            self._calls.eager_connect(backend, self.device)
            self._check(bound, what)
            probe = self._calls.probe(pg, self.device)
            while not probe.is_completed():
                self._check(bound, what)
                time.sleep(bound.poll_s / 4)
            probe.wait()
            self._check(bound, what)
            ready = True
        finally:
            if not ready:  # whatever went wrong: a half-built communicator is aborted, never destroyed
                self.abort(target, what)
        log.debug(
            "nccl_group_ready",
            what=what,
            rank=rank,
            world_size=world_size,
            device=str(self.device),
            nonblocking=nonblocking,
        )
        return pg

    @staticmethod
    def _check(bound: Bound, what: str) -> None:
        if bound.abandoned():
            raise PeerLost(f"{what}: given up while it was being built")
        if bound.expired():
            raise CollectiveTimeout(f"{what}: not built in time")

    def abort(self, target: Abortable, what: str) -> bool:
        """Abort ``target`` on a helper thread and wait for it, at most ``group_abort_s``.

        Returns:
            True when the abort returned (an error it raised is logged), False when it hung and
            ``on_abort_hung`` returned (only an injected one does).
        """
        failed: list[RuntimeError] = []

        def run() -> None:
            try:
                self._calls.abort(target)
            except RuntimeError as exc:  # DistBackendError included; logged below
                failed.append(exc)

        started = time.monotonic()
        t = threading.Thread(target=run, name="elasticd-nccl-abort", daemon=True)
        t.start()
        t.join(self._timeouts.group_abort_s)
        if t.is_alive():
            log.critical(
                "process_group_abort_hung",
                what=what,
                bound_s=self._timeouts.group_abort_s,
                exit_code=EXIT_GROUP_ABORT_HUNG,
            )
            self._on_abort_hung()
            return False
        if failed:
            log.warning("process_group_abort_failed", what=what, error=str(failed[0]))
        else:
            log.debug("process_group_aborted", what=what, duration_s=round(time.monotonic() - started, 4))
        return True
