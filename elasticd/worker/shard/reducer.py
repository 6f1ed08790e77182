"""The gradient sum of a sharded model across replicas, with the commit vote in its last bucket.

Owns ``ShardReducer``, the ``GradientReducer`` of a model sharded with FSDP2 over its replica
(``shard.replica``): backward has reduce-scattered every gradient inside the replica already
(each rank holds its shard of the replica's gradient, averaged over its K ranks), so after backward
each rank sums its local shard of every gradient with the same shard of every other replica (the
generation's shard group of its shard index), in flat buckets, the vote slots (``commit.Vote``)
behind the gradients of the last one. Each rank's loss is weighted by ``loss_scale`` before its
backward, so that the replica's average is its ranks' share of the global batch and the sum across
replicas is the global batch's mean gradient. The rule that a rank never contributes to a step
before it applied the sum it received (``ProtocolViolation``) is the data-parallel reducer's.
Never decides a verdict (``step.commit`` does), and never combines the replica's ranks' tallies
(``step.protocol`` does, through ``Replica.agree``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from elasticd.errors import CollectiveError, ConfigError
from elasticd.retry import Bound
from elasticd.worker.group.collectives import wait
from elasticd.worker.group.process_group import Group
from elasticd.worker.state.training import is_dtensor
from elasticd.worker.state.training import local_shard as local
from elasticd.worker.step.commit import VOTE_SLOTS
from elasticd.worker.step.reducer import DEFAULT_BUCKET_CAP_BYTES, all_finite, check_applied, vote_dtype


class _Flat:
    """The local gradient shards of some parameters of one dtype, flat in ``buffer``, and
    ``extra`` slots behind them."""

    def __init__(self, params: list[torch.nn.Parameter], extra: int, dtype: torch.dtype, device: torch.device) -> None:
        self.params = params
        self.sizes = [local(p).numel() for p in params]
        self.numel = sum(self.sizes)
        self.extra, self.dtype, self.device = extra, dtype, device
        self.work: dist.Work | None = None
        self.renew()

    def renew(self) -> None:
        """A new buffer: the old one is left to a collective that was abandoned, not ended (a peer
        can still complete it later through the retired group)."""
        self.buffer = torch.zeros(self.numel + self.extra, dtype=self.dtype, device=self.device)
        self.grads = self.buffer[: self.numel]

    def gather(self) -> None:
        """Every parameter's local gradient shard into the buffer (zeros for none)."""
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            dst = self.grads[offset : offset + n]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(local(p.grad).reshape(-1))
            offset += n

    def scatter(self) -> None:
        """The summed shards back into the parameters' gradients (made where backward left none)."""
        offset = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.sizes, strict=True):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = local(p.grad)
                g.copy_(self.grads[offset : offset + n].view(g.shape))
                offset += n


class ShardReducer:
    """Sums the local gradient shards of a sharded model across replicas (``GradientReducer``'s
    interface: ``begin``, ``finish``, ``applied``, ``cancel``), with the vote piggybacked."""

    VOTE_SLOTS = VOTE_SLOTS

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        replica_size: int,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        check_finite: bool = True,
    ) -> None:
        """``device``: the shard groups' (a bucket lives there); ``replica_size``: the ranks each
        replica's average is over (``loss_scale``).

        Raises:
            ConfigError: no trainable parameter is sharded (``fully_shard`` over the replica's
                mesh was not applied before the trainer was made).
        """
        trainable = [p for p in params if p.requires_grad]
        if not any(is_dtensor(p) for p in trainable):
            raise ConfigError(
                "replica_size > 1: shard the model with fully_shard(model, mesh=elasticd.replica_mesh()) "
                "before making its optimizer and the ElasticTrainer"
            )
        self._k, self._check_finite = replica_size, check_finite
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        self._buckets: list[_Flat] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(trainable):
            nbytes = local(p).numel() * p.element_size()
            if current and (size + nbytes > bucket_cap_bytes or p.dtype != current[0].dtype):
                self._buckets.append(_Flat(current, 0, current[0].dtype, device))
                current, size = [], 0
            current.append(p)
            size += nbytes
        own = vote_dtype(current[0].dtype)
        if own is None:
            self._buckets.append(_Flat(current, VOTE_SLOTS, current[0].dtype, device))
        else:
            self._buckets.append(_Flat(current, 0, current[0].dtype, device))
            self._buckets.append(_Flat([], VOTE_SLOTS, own, device))
        self._vote_bucket = self._buckets[-1]
        self._params = trainable
        self._group: Group | None = None
        self._vote: Callable[[], Sequence[float]] | None = None
        self._step = 0
        self._finite: list[torch.Tensor | bool] = []
        self._unapplied: tuple[int, int] | None = None
        self.vote_sent_at = 0.0

    def loss_scale(self, weight: float) -> float:
        """What a rank's loss is multiplied by before its backward: its share of the global batch
        (``weight``) times the replica's size, which FSDP2's average over the replica divides away."""
        return weight * self._k

    def close(self) -> None:
        """Nothing to release (no hooks)."""

    def begin(
        self, group: Group, step: int, scale: float, vote: Callable[[], Sequence[float]], sync: bool = True
    ) -> None:
        """Arm for ``step`` in shard group ``group``: the gradients are dropped (FSDP2 makes them
        anew in backward; this replaces ``optimizer.zero_grad``); ``vote`` gives the slots right
        before the last bucket goes out. ``scale`` and ``sync`` are the data-parallel reducer's:
        the loss carries the weight here (``loss_scale``), and the sum runs once, after the last
        micro-batch, either way.

        Raises:
            ProtocolViolation: this rank received the sum of an earlier step in ``group`` and did
                not apply it (``applied``).
        """
        check_applied(self._unapplied, group, step)
        self._group, self._vote, self._step, self._finite = group, vote, step, []
        for p in self._params:
            p.grad = None

    def rearm(self, group: Group, scale: float) -> None:
        """The open step moves to ``group`` (nothing went out yet: the sum runs at ``finish``)."""
        self._group = group

    def sync_next(self) -> None:
        """Nothing: the sum runs at ``finish``."""

    def applied(self, step: int) -> None:
        """This rank applied ``step``, whose sum ``finish`` delivered."""
        if self._unapplied is not None and self._unapplied[1] == step:
            self._unapplied = None

    def local_nonfinite(self) -> bool:
        """This rank's local gradient shards of the step hold a NaN or an infinity (False unchecked)."""
        return not all(bool(f) for f in self._finite)

    def replay(self) -> None:
        raise ValueError("a sharded step is not summed again without its backward")

    def finish(self, bound: Bound) -> list[float]:
        """Sum every bucket across the shard group, write the sums back into the gradients.

        Returns:
            The summed vote slots (of this shard group: ``Replica.agree`` adds the others').

        Raises:
            CollectiveError: a bucket failed, timed out, or the generation was abandoned.
        """
        group = self._group
        assert group is not None, "begin() was not called"
        try:
            for b in self._buckets:
                b.gather()
                if self._check_finite and b.numel:
                    self._finite.append(all_finite(b.grads, b.buffer.device.type == "cpu"))
            assert self._vote is not None
            self.vote_sent_at = time.monotonic()
            slots = self._vote()
            assert len(slots) == VOTE_SLOTS, len(slots)
            tail = self._vote_bucket.buffer[self._vote_bucket.numel :]
            tail.copy_(torch.tensor(list(slots), dtype=tail.dtype))
            for b in self._buckets:
                try:
                    b.work = group.pg.allreduce([b.buffer], self._opts)
                except RuntimeError as exc:
                    raise CollectiveError(f"gradient all_reduce could not start: {exc}") from exc
            for b in self._buckets:
                assert b.work is not None
                wait(b.work, group, bound, "gradient all_reduce")
            for b in self._buckets:
                b.scatter()
            self._unapplied = (group.generation, self._step)
        finally:
            self._group, self._vote = None, None
        return [float(x) for x in self._vote_bucket.buffer[self._vote_bucket.numel :].tolist()]

    def cancel(self) -> None:
        """Forget a step whose collectives will never be waited for; every bucket that went out
        gets a new buffer."""
        self._group, self._vote, self._unapplied = None, None, None
        for b in self._buckets:
            if b.work is not None:
                b.renew()
            b.work = None
