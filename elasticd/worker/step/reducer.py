"""DDP-style bucketed gradient averaging, with the commit vote in the last bucket.

Owns ``GradientReducer``: the gradients grouped in buckets (reverse parameter order, like DDP),
each bucket's all_reduce launched from a post-accumulate-grad hook as soon as its gradients are
ready, the vote slots (``commit.Vote``) written into the bucket launched last, and the rule that a
rank never contributes to a step before it applied the sum it received (``ProtocolViolation``).
Its waits are ``group.collectives.wait``'s. Never decides a verdict (``commit`` does).
"""

from __future__ import annotations

import math
import time

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from elasticd.errors import CollectiveError, ProtocolViolation
from elasticd.retry import Bound
from elasticd.worker.group.collectives import wait
from elasticd.worker.group.process_group import Group
from elasticd.worker.step.commit import VOTE_SLOTS

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DDP's default bucket size


class _Bucket:
    """Gradients of parameters of one dtype on one device, flat in ``buffer`` (on their device).
    Where the group's device differs (NCCL with a model on the CPU, gloo with one on a GPU), the
    all_reduce runs on ``staging``, a copy of the buffer on the group's device."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        extra: int,
        comm_device: torch.device,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``dtype`` and ``device``: the buffer's, for a bucket of no parameters (the vote alone)."""
        self.params = params
        self.dtype = params[0].dtype if dtype is None else dtype
        self.device = params[0].device if device is None else device
        self.on_cpu = self.device.type == "cpu"
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.extra = extra
        self.ready = 0
        self.work: dist.Work | None = None
        self.comm_device = comm_device
        self.kept: torch.Tensor | None = None  # this rank's own gradients of step ``kept_step``, where kept
        self.kept_step = -1
        self.renew()

    def renew(self) -> None:
        """A new buffer (and new ``.grad`` views at the next ``bind_grads``). The old one is left
        to a collective that was abandoned, not ended: a peer that was frozen or cut off can still
        complete it later through the retired group, and it would then write its sum into the
        gradients of a step in the next generation (seen under chaos: ranks' parameters diverged)."""
        device = self.device
        self.buffer = torch.zeros(self.numel + self.extra, dtype=self.dtype, device=device)
        self.staging = (
            None
            if same_device(device, self.comm_device)
            else torch.zeros(self.numel + self.extra, dtype=self.buffer.dtype, device=self.comm_device)
        )
        self.grads = self.buffer[: self.numel]  # every gradient of the bucket, flat
        # the vote slots as a NumPy view where the buffer allows one (a CPU buffer of a dtype NumPy
        # has): writing the slots through it costs no tensor construction on the step path
        tail = self.buffer[self.numel :]
        self.slot_view = tail.numpy() if self.extra and self.on_cpu and _numpy_viewable(tail) else None
        self.views = []
        offset = 0
        for p, n in zip(self.params, self.sizes, strict=True):
            self.views.append(self.buffer[offset : offset + n].view_as(p))
            offset += n

    def bind_grads(self) -> None:
        """Zero the bucket and make each parameter's ``.grad`` its view into it (DDP's
        ``gradient_as_bucket_view``): backward then accumulates straight into the bucket, and the
        averaged gradients are in place once the all_reduce completes, with no copy either way."""
        self.buffer.zero_()
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def read_slots(self) -> list[float]:
        """The slots in the buffer's tail (after the all_reduce: the summed vote)."""
        if self.slot_view is not None:
            return self.slot_view.tolist()  # type: ignore[no-any-return]
        return [float(x) for x in self.buffer[self.numel :].tolist()]

    def write_slots(self, slots: Sequence[float]) -> None:
        """The vote's slots into the buffer's tail, behind the gradients."""
        if self.slot_view is not None:
            self.slot_view[:] = slots
        else:
            self.buffer[self.numel :] = torch.tensor(slots, dtype=self.buffer.dtype, device=self.buffer.device)

    def outbound(self) -> torch.Tensor:
        """The tensor the all_reduce sums: the buffer, or its copy on the group's device."""
        if self.staging is None:
            return self.buffer
        return self.staging.copy_(self.buffer)

    def inbound(self) -> None:
        """After the all_reduce completed: the sum into the buffer (so into ``.grad``)."""
        if self.staging is not None:
            self.buffer.copy_(self.staging)

    def gather_grads(self) -> None:
        """Copy in any gradient that is not the bucket's view (user code replaced ``.grad``)."""
        for p, view in zip(self.params, self.views, strict=True):
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view


def _numpy_viewable(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float64, torch.float16)


def all_finite(grads: torch.Tensor, on_cpu: bool) -> torch.Tensor | bool:
    """Every element of ``grads`` is finite (no NaN, no infinity), exactly. On the CPU one sum
    decides the common case: a NaN or an infinity carries into the sum, so a finite sum means every
    element is finite; only a non-finite sum (a bad element, or a sum that overflowed alone) pays the
    element-wise test, which costs several times the sum. Elsewhere the element-wise test, as a
    tensor: nothing waits for the device until the vote reads it."""
    if not on_cpu:
        return torch.isfinite(grads).all()
    accumulate = torch.float32 if grads.dtype in (torch.float16, torch.bfloat16) else None
    return math.isfinite(grads.sum(dtype=accumulate)) or bool(torch.isfinite(grads).all())


def check_applied(unapplied: tuple[int, int] | None, group: Group, step: int) -> None:
    """A rank contributes to ``step`` in ``group`` only after applying the step whose sum it
    received in that group (``unapplied``: its (generation, step), None when applied).

    Raises:
        ProtocolViolation: it did not: contributing now would confirm a step it does not hold.
    """
    if unapplied is not None and unapplied[0] == group.generation and unapplied[1] != step:
        raise ProtocolViolation(
            f"step {step}: rank {group.rank} of generation {group.generation} would contribute before "
            f"applying step {unapplied[1]}, whose sum it received"
        )


def vote_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the vote slots need when the last gradient bucket is of ``dtype``: None (they ride
    in that bucket) where it counts every member exactly and keeps the loss to float32's precision
    (float32, float64), else float32 in a bucket of their own, one more small all_reduce per step.
    bfloat16 counts exactly only to 256 and float16 to 2,048: a larger generation's voter count
    would round, and every step would abort. Pure."""
    return None if dtype in (torch.float32, torch.float64) else torch.float32


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (``cuda`` and ``cuda:<current>`` are). Pure but for the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    if a.index is not None and b.index is not None:
        return False
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


class GradientReducer:
    """Averages gradients across a generation's ranks, DDP-style, with the commit vote piggybacked.

    Gradients are grouped in buckets (reverse parameter order, like DDP), and a bucket's all_reduce
    is launched from a post-accumulate-grad hook as soon as all of its gradients are ready, so
    communication overlaps the rest of backward. Each parameter's ``.grad`` is a view into its
    bucket (bound by ``begin``), so backward writes the bucket directly and the average lands in
    ``.grad`` without copies; one multiply per bucket applies this rank's weight. The bucket
    launched last carries the vote slots (``commit.Vote``): each rank writes its vote there just
    before that bucket is launched (so the vote says what the member knew as late as possible) and
    reads the sum once the bucket completes. An all_reduce only completes on a rank after every rank
    contributed, so a completed vote is every member's vote. Where that bucket's dtype would round
    the vote (bfloat16, float16: ``vote_dtype``), the slots go in a float32 bucket of their own,
    launched after every gradient bucket.
    """

    VOTE_SLOTS = VOTE_SLOTS

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        device: torch.device,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        keep_local: bool = False,
        check_finite: bool = True,
    ) -> None:
        """``keep_local``: keep a copy of this rank's own gradients of each step (one more
        gradient-sized buffer), so a step whose all_reduce failed can be summed again in the next
        generation without its backward (``replay``). ``check_finite``: test this rank's own
        gradients for NaN and infinity as each bucket goes out (``local_nonfinite``, for the vote);
        off where a GradScaler owns that decision."""
        self._keep = keep_local
        self._check_finite = check_finite
        self._finite: list[torch.Tensor | bool] = []  # per bucket gone out this step: all of its gradients finite
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        self.vote_sent_at = 0.0  # monotonic time the vote bucket of the last step went out (0: never)
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters")
        self._buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(trainable):
            if current and (
                size + p.numel() * p.element_size() > bucket_cap_bytes
                or p.dtype != current[0].dtype
                or p.device != current[0].device
            ):
                self._buckets.append(_Bucket(current, 0, device))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        own = vote_dtype(current[0].dtype)
        if own is None:
            self._buckets.append(_Bucket(current, self.VOTE_SLOTS, device))
        else:  # launched last, after every gradient bucket (``finish``): the vote is still the latest word
            self._buckets.append(_Bucket(current, 0, device))
            self._buckets.append(_Bucket([], self.VOTE_SLOTS, device, own, current[0].device))
        self._vote_bucket = self._buckets[-1]
        self._where = {id(p): b for b in self._buckets for p in b.params}
        self._group: Group | None = None
        self._scale = 1.0
        self._vote: Callable[[], Sequence[float]] | None = None
        self._step = 0
        # (generation, step) whose sum ``finish`` delivered here and that is not applied yet (not the
        # group itself: holding it kept retired groups alive)
        self._unapplied: tuple[int, int] | None = None
        self._syncing = True  # False while micro-batches before the last accumulate (begin(sync=False))
        self._error: BaseException | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in trainable
        ]

    def loss_scale(self, weight: float) -> float:
        """What a rank's loss is multiplied by before its backward: nothing here (the rank's share,
        ``weight``, multiplies its gradients as they go out); a sharded model's reducer differs."""
        return 1.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def begin(
        self, group: Group, step: int, scale: float, vote: Callable[[], Sequence[float]], sync: bool = True
    ) -> None:
        """Arm for ``step``: zero the gradients (this replaces ``optimizer.zero_grad``); this rank's
        gradients will be multiplied by ``scale`` before the sum; ``vote`` is called (on the thread
        that launches it) right before the vote bucket goes out, and returns its slots. With
        ``sync=False`` (gradient accumulation, like DDP's ``no_sync``) backward only accumulates
        into the buckets until ``sync_next``: the all_reduce runs once per step.

        Raises:
            ProtocolViolation: this rank received the sum of an earlier step in ``group`` and did
                not apply it (``applied``): contributing now would confirm a step it does not hold.
        """
        check_applied(self._unapplied, group, step)
        self._group, self._scale, self._error, self._vote = group, scale, None, vote
        self._step = step
        self._syncing = sync
        self._finite = []
        for b in self._buckets:
            b.ready, b.work = 0, None
            b.bind_grads()

    def rearm(self, group: Group, scale: float) -> None:
        """The open step moves to ``group`` (a regroup between its micro-batches, before any bucket
        went out): the gradients accumulated so far stay in the buckets."""
        if any(b.work is not None for b in self._buckets):
            raise ProtocolViolation("a step whose buckets went out cannot move to another group")
        self._group, self._scale, self._error = group, scale, None

    def applied(self, step: int) -> None:
        """This rank applied ``step``, whose sum ``finish`` delivered: it may contribute to the next one."""
        if self._unapplied is not None and self._unapplied[1] == step:
            self._unapplied = None

    def sync_next(self) -> None:
        """The next backward is the step's last micro-batch: launch each bucket as it completes."""
        self._syncing = True

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._group is None or not self._syncing:
            return
        bucket = self._where[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.work is not None or self._group is None:
            return
        bucket.gather_grads()
        if self._keep and bucket.kept_step != self._step:  # kept even where the step already failed
            if bucket.kept is None:
                bucket.kept = torch.empty_like(bucket.grads)
            bucket.kept.copy_(bucket.grads)
            bucket.kept_step = self._step
        if self._error is not None:
            return
        if self._scale != 1.0:
            bucket.grads.mul_(self._scale)
        if self._check_finite and bucket.numel:
            self._finite.append(all_finite(bucket.grads, bucket.on_cpu))
        if bucket is self._vote_bucket and self._vote is not None:
            self.vote_sent_at = time.monotonic()  # this rank's compute of the step ends: its contribution
            slots = self._vote()
            assert len(slots) == bucket.extra, (len(slots), bucket.extra)
            bucket.write_slots(slots)
        flat = bucket.outbound()
        try:
            bucket.work = self._group.pg.allreduce([flat], self._opts)
        except RuntimeError as exc:  # a broken group can refuse at launch; latch, never raise in autograd
            self._error = CollectiveError(f"gradient all_reduce could not start: {exc}")

    def local_nonfinite(self) -> bool:
        """This rank's own gradients of the step, in the buckets gone out so far, hold a NaN or an
        infinity (the vote bucket goes out last, so its vote sees every bucket). False unchecked."""
        return not all(bool(f) for f in self._finite)

    def replay(self) -> None:
        """After ``begin`` in a new group: this rank's kept gradients of the step (``keep_local``)
        go out again, as if its backward had just ended.

        Raises:
            ValueError: nothing was kept (the reducer does not keep, or no bucket went out).
        """
        if not self._keep or any(b.kept is None or b.kept_step != self._step for b in self._buckets if b.params):
            raise ValueError(f"no kept gradients of step {self._step} to sum again")
        for b in self._buckets:
            if b.kept is not None:
                b.grads.copy_(b.kept)
            b.ready = len(b.params)
        self._syncing = True
        self._finite = []

    def finish(self, bound: Bound) -> list[float]:
        """Launch what backward did not, wait for every bucket, write the averaged gradients back.

        Returns:
            The summed vote slots.

        Raises:
            CollectiveError: a bucket failed, timed out, or the generation was abandoned.
        """
        group = self._group
        assert group is not None, "begin() was not called"
        try:
            for b in self._buckets:
                self._launch(b)
            if self._error is not None:
                raise self._error
            for b in self._buckets:
                assert b.work is not None
                wait(b.work, group, bound, "gradient all_reduce")
            for b in self._buckets:
                b.inbound()
            self._unapplied = (group.generation, self._step)
        finally:
            self._group, self._vote = None, None
        return self._vote_bucket.read_slots()

    def cancel(self) -> None:
        """Forget a step whose collectives will never be waited for (its group is being retired).
        Every bucket that went out gets a new buffer (``_Bucket.renew``)."""
        self._group, self._vote, self._unapplied = None, None, None
        for b in self._buckets:
            if b.work is not None:
                b.renew()
            b.work = None
