"""The elasticd exception hierarchy.

Owns every exception type elasticd raises. Imports nothing from elasticd.

``TransientError`` may be retried after backoff or a new rendezvous; ``FatalError`` means stop and
report. Third-party exceptions are translated into these in the module that imports the library,
always with ``raise Ours(...) from exc``.
"""

from __future__ import annotations


class ElasticdError(Exception):
    """Root of every error raised by elasticd."""


class TransientError(ElasticdError):
    """A failure that may go away after backoff or re-rendezvous."""


class FatalError(ElasticdError):
    """A failure that retrying cannot fix: stop and report."""


class EtcdUnavailable(TransientError):
    """etcd could not be reached or did not answer in time (after the retry bound)."""


class LeaseLost(TransientError):
    """This member's etcd lease no longer exists (it expired, e.g. while the process was frozen)."""


class StaleGeneration(TransientError):
    """The generation this member acted on is no longer current."""


class CollectiveError(TransientError):
    """A torch.distributed collective failed (a peer crashed, a connection broke)."""


class CollectiveTimeout(CollectiveError):
    """A collective did not finish within its bound."""


class PeerLost(CollectiveError):
    """A member of the current generation lost its lease or the generation was aborted."""


class CheckpointTransferError(TransientError):
    """The state broadcast to newcomers failed."""


class ConfigError(FatalError):
    """A setting is missing or invalid; the message names the setting."""


class EtcdRefused(FatalError):
    """etcd answered and refused the request (authentication is off, or the user may not do it)."""


class PermissionDenied(EtcdRefused):
    """etcd refused a request for lack of permission: the etcd user's role does not cover the keys.

    Never retried (each attempt meets the same role); the message names the job, the user and the
    key range its role must grant (``elasticctl auth setup-job``).
    """


class RendezvousClosed(FatalError):
    """No generation could be formed within the join timeout, or the job is closed."""


class ModelMismatch(FatalError):
    """This worker's model (parameter names, shapes, dtypes) differs from the job's."""


class CheckpointModelChanged(ModelMismatch):
    """The job's checkpoint directory holds checkpoints of another model and none that this worker
    can resume from; starting over from step 1 is allowed only with ``checkpoint_allow_new_model``."""


class GradientsNotFinite(FatalError):
    """This member's own gradients were not finite at ``retry.nonfinite_steps`` steps in a row: its
    node is taken as bad, and the member leaves (its worker exits ``EXIT_NO_RESTART``)."""


class ProtocolViolation(FatalError):
    """The step protocol's own invariant broke (a bug, never a fault): a member was about to
    contribute to a step before applying the one whose sum it received."""


# A worker's exit code meaning "start me again as a newcomer" (``MemberReplaced``): its agent
# restarts it at once, outside the restart budget (sysexits' EX_TEMPFAIL).
EXIT_REJOIN = 75
# A worker's exit code meaning "fatal: do not start me again" (sysexits' EX_CONFIG): its agent
# stops its workers and exits 3 instead of restarting it. A worker exits with it on an uncaught
# ``ConfigError`` or ``ModelMismatch``; a script may exit with it too (``sys.exit(78)``).
EXIT_NO_RESTART = 78


class MemberReplaced(SystemExit):
    """The drop-in form: a regroup gave this member the job's state in the middle of its script's
    step (it missed steps the others committed while it was stopped or cut off), so its loop cannot
    go on: the process exits with ``EXIT_REJOIN``, and its agent starts it again as a newcomer."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_REJOIN)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class ReplicaBroken(SystemExit):
    """Sharded training: this rank cannot tell what its replica's other ranks did with a step or a
    sync (their common collective failed), so the replica's state may differ between its ranks: the
    process exits with ``EXIT_REJOIN``, and its agent ends the replica's other ranks and starts all
    of them again as a newcomer replica (the job holds the state elsewhere)."""

    def __init__(self, reason: str) -> None:
        super().__init__(EXIT_REJOIN)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class StateCorrupt(FatalError):
    """Training state differs between ranks after a sync, or a record is unreadable."""


class StateLost(FatalError):
    """No live member holds the job's newest committed state (every member that had it is gone)."""


class JobFinished(ElasticdError):
    """The job already reached its target step; a late joiner has nothing to do. ``generation``
    and ``step``: the ``finished`` record's (-1 where none was read)."""

    def __init__(self, reason: str, generation: int = -1, step: int = -1) -> None:
        super().__init__(reason)
        self.generation, self.step = generation, step


class RestartsExhausted(FatalError):
    """A step failed more times than the retry policy allows."""
