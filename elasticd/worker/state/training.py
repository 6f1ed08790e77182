"""Training state: what a member holds, its arena and its checksum.

Owns ``TrainingState`` (the model's and the optimizer's state dicts, the state of the objects
registered beside them, the step counter, the data position, the CPU and CUDA RNG states, the lineage) and the
flat "arena" its CPU tensors live in: the JSON layout that describes the arena, ``pack`` (the layout
and the arena, as sent to newcomers and written to disk) and ``unpack`` (a peer's or a file's layout
and buffer, decoded and checked before anything is loaded; data only, never pickled objects). Owns
``ChecksumAhead`` and the model signature. Never encodes a state dict's values itself (``extras``
does), never defines the checksum (``checksum`` does) or where the RNG states sit (``rng`` does),
never moves the state between ranks (``sync`` does), never touches the disk (``durable`` does), and
never decides who rank 0 is.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import reprlib
import sys
import threading
from dataclasses import dataclass
from typing import Any, Protocol, cast

import structlog
import torch

from elasticd.errors import ConfigError, ModelMismatch, StateCorrupt
from elasticd.retry import Deadline
from elasticd.worker.state.checksum import MASK63, StateHasher, checksum_key, state_checksum
from elasticd.worker.state.extras import STATE_DICT_HINT, JsonValue, decode, encode, like_devices, load_in_place
from elasticd.worker.state.rng import CudaRng, DeviceRng, rng_states, split_rng_states

log = structlog.get_logger(__name__)

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_ALIGN = 64  # cache-line aligned: parameters live in the arena, and vector kernels like it
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")  # no ".": it ends the name in "extra.<name>.<path>"
_ADOPTED = ("model.", "optim.")  # tensors that come to live in the arena; a registered object's are copied
_LOAD_ERRORS = (ValueError, TypeError, KeyError, IndexError, RuntimeError, AttributeError)
_PLAIN_HINT = (
    "Keep only tensors and plain data in the registered value, or register an object whose "
    "state_dict() and load_state_dict() convert it"
)


@dataclass
class Counters:
    """The scalar progress of training, part of the synced state."""

    step: int = 0  # committed steps so far
    epoch: int = 0  # current epoch of the data order
    position: int = 0  # global sample offset within the epoch
    reference_world: int = 0  # the first generation's size (DataPlan.reference); 0: not set (older files)

    def as_list(self) -> list[int]:
        return [self.step, self.epoch, self.position, self.reference_world]


class _Stateful(Protocol):
    def state_dict(self) -> object: ...

    def load_state_dict(self, state_dict: object) -> object: ...


class _PlainValue:
    """A registered plain value (a dict, a list or a tensor of plain data) as a stateful object: its
    state dict is the value itself, and loading one updates the value in place (``load_in_place``),
    so the caller's reference to it sees the state loaded."""

    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> object:
        return self.value

    def load_state_dict(self, state_dict: object) -> None:
        load_in_place(self.value, state_dict)


@dataclass
class _Decoded:
    """A peer's state, decoded and checked, not yet loaded."""

    model_sd: dict[str, torch.Tensor]
    optim_sd: dict[str, object]
    extras: dict[str, object]
    counters: Counters
    rng: torch.Tensor
    device_rngs: list[torch.Tensor]
    entries: list[list[object]]
    arena_key: str
    key: bytes


class TrainingState:
    """The model, the optimizer, the registered objects and the counters of one worker.

    The state's CPU tensors live in one flat "arena" buffer once it has been packed or received:
    parameters, buffers and optimizer tensors become views into it, so rank 0 broadcasts the arena
    without copying, a newcomer adopts the buffer it received without copying, and the checksum is
    one pass over contiguous memory. A tensor that has moved out (an optimizer creating its state
    at its first step) is copied back in at the next pack. The tensors of registered objects are
    copied in at every pack and never adopted: those objects keep tensors of their own.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device_rng: DeviceRng | None = None
    ) -> None:
        """``device_rng``: the accelerators' generators (default: ``CudaRng``)."""
        self.model = model
        self.optimizer = optimizer
        self.counters = Counters()
        self.lineage = -1  # the generation whose sync last proved this state every member's (-1: none)
        self.signature = model_signature(model)
        self.device_rng: DeviceRng = device_rng if device_rng is not None else CudaRng()
        self._extras: dict[str, _Stateful] = {}
        self._arena: torch.Tensor | None = None
        self._arena_key: str = ""  # the arena's entries and RNG sizes: it is reused while they stay
        self._arena_entries: list[list[object]] = []
        self._received_key: bytes | None = None  # checksum_key of the layout whose bytes the arena holds
        self.loads = 0  # states loaded from a peer or a file so far (``unpack``)
        # Names of the tensors that are a sharded (FSDP2) tensor's local shard: they travel and
        # persist as the shard, are copied in at every pack and never adopted (FSDP2 owns their storage).
        self._sharded: set[str] = set()

    # -- registered objects ------------------------------------------------------------------

    def register(self, name: str, obj: object) -> None:
        """Make ``obj``'s state part of the training state under ``name``: it travels to newcomers,
        is saved to and loaded from checkpoints, and is checksummed, like the model's.

        ``obj`` is anything with ``state_dict()`` and ``load_state_dict(state_dict)``: an LR
        scheduler, a second optimizer, a ``torch.amp.GradScaler``, an EMA of the weights, a token
        counter. Its ``state_dict()`` is read at every pack (``extras.encode``): its tensors are
        copied into the arena, every other value goes into the layout as JSON. Every worker must
        register the same objects under the same names before it syncs or loads a checkpoint; a
        scheduler after the registered optimizer it drives.

        ``obj`` may also be plain data, registered as it is: a dict, a list or a tensor built of
        tensors, numbers, strings, bools, None and nested dicts and lists (an EMA kept as
        ``{name: tensor}``, a list of tensors, counters as ``{"tokens": 0}``). It is its own state
        dict, and loading a state updates it in place (``extras.load_in_place``): its tensors by
        ``copy_`` (same shape and dtype), its dicts and lists keeping their identity, so the
        caller's reference sees the state loaded. ``registered()`` gives the value itself.

        Raises:
            ConfigError: ``name`` is empty, not letters, digits, "_" and "-", or taken; ``obj`` lacks
                ``state_dict``/``load_state_dict`` and is not plain data held in a dict, a list or
                a tensor (an int, a float, a str, a bool, None or a tuple cannot be updated in
                place), is this state's model or optimizer, or is registered already; it is an LR
                scheduler bound to an optimizer that is neither this state's nor a registered one;
                or its state dict holds a value that is neither a tensor nor plain data (the
                message names the path of that value).
        """
        label = f"registered object {name!r} ({type(obj).__qualname__})"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"register: the name {name!r} must be a non-empty string of letters, digits, "
                f"'_' and '-' (not starting with '-')"
            )
        if name in self._extras:
            raise ConfigError(
                f"register: the name {name!r} is taken by a "
                f"{type(_user_object(self._extras[name])).__qualname__}; each object needs its own name"
            )
        stateful = _as_stateful(name, obj, label)
        label = _label(name, stateful)
        if obj is self.model or obj is self.optimizer:
            raise ConfigError(
                f"{label} is the trainer's {'model' if obj is self.model else 'optimizer'}, "
                f"whose state is part of the training state already"
            )
        for other, known in self._extras.items():
            if _user_object(known) is obj:
                raise ConfigError(f"{label} is registered already, as {other!r}")
        schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if isinstance(obj, schedulers):
            bound = getattr(obj, "optimizer", None)
            if bound is not self.optimizer and not any(bound is o for o in self._extras.values()):
                raise ConfigError(
                    f"{label}: scheduler bound to another optimizer (a "
                    f"{type(bound).__qualname__} that is neither the trainer's optimizer nor a "
                    f"registered one); register that optimizer first, or build the scheduler "
                    f"on the trainer's optimizer"
                )
        _encode_registered(name, stateful)
        self._extras[name] = stateful

    def registered(self) -> dict[str, object]:
        """The registered objects by name, in the order of registration (a plain value: the value itself)."""
        return {name: _user_object(obj) for name, obj in self._extras.items()}

    def _encode_extras(self) -> tuple[dict[str, JsonValue], list[tuple[str, torch.Tensor]]]:
        trees: dict[str, JsonValue] = {}
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, obj in self._extras.items():
            tree, found = _encode_registered(name, obj)
            trees[name] = tree
            tensors += [(f"extra.{name}.{path}", t) for path, t in found]
        return trees, tensors

    # -- flat layout -------------------------------------------------------------------------

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state, in a canonical order (checksummed and broadcast)."""
        return self._tensors(self.optimizer.state_dict(), self._encode_extras()[1])

    def _tensors(
        self, optim_sd: dict[str, object], extra: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        out = [(f"model.{k}", self._local(f"model.{k}", v)) for k, v in self.model.state_dict().items()]
        state: dict[int, dict[str, object]] = optim_sd["state"]  # type: ignore[assignment]
        for idx in sorted(state):
            for key in sorted(state[idx]):
                value = state[idx][key]
                if isinstance(value, torch.Tensor):
                    out.append((f"optim.{idx}.{key}", self._local(f"optim.{idx}.{key}", value)))
        out += extra
        out.append(("counters", torch.tensor(self.counters.as_list(), dtype=torch.int64)))
        return out

    def _local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t``, or its local shard where it is sharded (noted in ``_sharded``)."""
        if is_dtensor(t):
            self._sharded.add(name)
        return local_shard(t)

    def checksum(self) -> int:
        """A 63-bit XXH3 hash of the packed state bytes, seeded with ``checksum_key`` of the layout
        (the tensors' names, dtypes and shapes, the optimizer's param groups and scalars, the
        registered objects' state) (``state_checksum``). It catches divergence and corrupt
        transfers between our own ranks (a random change escapes it with p ~ 2^-63); it is no
        defence against an adversary, and it is one pass over contiguous memory (~3 ms for 34 MB
        here; CRC-32 took ~12 ms). The RNG states are not part of it."""
        layout, tensors, rngs = self._layout_and_tensors()
        arena = self._refresh_arena(layout, tensors, rngs)
        total = int(layout["total"])  # type: ignore[call-overload]
        return state_checksum(checksum_key(layout), arena[:total].numpy().data, total)

    def streamed_checksum(self, hasher: StateHasher) -> int | None:
        """``checksum()`` from a ``state_hasher`` seeded with the received layout's ``checksum_key``
        and fed the arena's state bytes as they arrived; valid only right after ``unpack`` on CPU,
        if the state's layout is still the one received and every state tensor still holds the
        received bytes (the model's and optimizer's live in the arena; a registered object's
        equal their bytes there); else None."""
        arena = self._arena
        if arena is None or self._received_key is None:
            return None
        layout, tensors, _ = self._layout_and_tensors()
        if checksum_key(layout) != self._received_key:
            return None  # e.g. a registered object that normalized the state it was given
        base = arena.data_ptr()
        for (name, t), entry in zip(tensors, self._arena_entries, strict=True):
            offset, nbytes = cast(int, entry[3]), cast(int, entry[4])
            if name == "counters" or not nbytes:
                continue  # counters were decoded from those very bytes
            if not name.startswith(_ADOPTED):
                if not torch.equal(arena[offset : offset + nbytes], _bytes_of(t)):
                    return None
            elif t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() != base + offset:
                return None
        return hasher.intdigest() & MASK63

    def layout(self) -> dict[str, object]:
        """The JSON description needed to rebuild the state from the flat buffer."""
        return self._layout_and_tensors()[0]

    def _layout_and_tensors(
        self,
    ) -> tuple[dict[str, object], list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """(layout, the state tensors, the RNG states: CPU first, then each device's)."""
        optim_sd = self.optimizer.state_dict()  # once: it walks every parameter's state
        trees, extra = self._encode_extras()
        tensors = self._tensors(optim_sd, extra)
        entries: list[list[object]] = []
        offset = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append([name, str(t.dtype), list(t.shape), offset, nbytes])
            offset += _aligned(nbytes)
        groups, in_groups = encode(optim_sd["param_groups"], "the optimizer's param_groups")
        if in_groups:
            raise ConfigError(
                f"the optimizer's param_groups hold a tensor at {in_groups[0][0]} (a tensor lr?); "
                f"they travel as JSON: use a Python number"
            )
        scalars: dict[str, object] = {}
        for idx, st in optim_sd["state"].items():
            for key, value in st.items():
                if not isinstance(value, torch.Tensor):
                    scalars[f"{idx}.{key}"] = value
        rngs = rng_states(self.device_rng)
        layout: dict[str, object] = {
            "tensors": entries,
            "total": offset,
            "param_groups": groups,
            "optim_scalars": encode(scalars, "the optimizer's state")[0],
            "extras": trees,
            "rng": [rngs[0].numel()],
            "cuda_rng": [r.numel() for r in rngs[1:]],
        }
        return layout, tensors, rngs

    def pack(self) -> tuple[bytes, torch.Tensor]:
        """The layout (strict JSON bytes) and the flat uint8 buffer (state tensors, then the CPU RNG
        state, then each CUDA device's).

        The buffer is this state's arena: it is what rank 0 broadcasts, and it stays the storage
        of the state, so it must not be written to.

        Raises:
            ConfigError: a registered object's state dict now holds a value that cannot travel.
        """
        layout, tensors, rngs = self._layout_and_tensors()
        arena = self._refresh_arena(layout, tensors, rngs)
        return json.dumps(layout, allow_nan=False).encode(), arena

    def _refresh_arena(
        self, layout: dict[str, object], tensors: list[tuple[str, torch.Tensor]], rngs: list[torch.Tensor]
    ) -> torch.Tensor:
        entries = cast(list[list[object]], layout["tensors"])
        total = int(layout["total"])  # type: ignore[call-overload]
        key = json.dumps([entries, [r.numel() for r in rngs]])
        size = total + sum(r.numel() for r in rngs)
        arena = self._arena
        if arena is None or key != self._arena_key or arena.numel() != size:
            arena = torch.zeros(size, dtype=torch.uint8)  # zeroed padding
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for (name, t), entry in zip(tensors, entries, strict=True):
            offset, nbytes = cast(int, entry[3]), cast(int, entry[4])
            if not nbytes:
                continue
            region = arena[offset : offset + nbytes]
            if t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() == region.data_ptr():
                continue  # it lives there already
            region.copy_(_bytes_of(t))
            if t.device.type == "cpu" and name.startswith(_ADOPTED) and name not in self._sharded:
                self._adopt(name, region.view(t.dtype).view(t.shape), params)
        at = total
        for r in rngs:
            arena[at : at + r.numel()].copy_(_bytes_of(r))
            at += r.numel()
        self._arena, self._arena_key, self._arena_entries = arena, key, entries
        self._received_key = None  # the arena holds this state's bytes now, not necessarily those received
        return arena

    def _adopt(self, name: str, view: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Make the state tensor called ``name`` live in ``view`` (same dtype, shape and values);
        ``params`` is the optimizer's parameters in state-dict index order."""
        kind, _, rest = name.partition(".")
        if kind == "model":
            prefix, _, attr = rest.rpartition(".")
            module = self.model.get_submodule(prefix) if prefix else self.model
            param = module._parameters.get(attr)
            if param is not None:
                param.data = view
            elif module._buffers.get(attr) is not None:
                module._buffers[attr] = view
        elif kind == "optim":
            idx, _, key = rest.partition(".")
            self.optimizer.state[params[int(idx)]][key] = view

    def unpack(self, layout_bytes: bytes, flat: torch.Tensor) -> None:
        """Load the state from a peer's layout and buffer (data only; nothing is executed).

        Everything is decoded and checked before anything is loaded, so a bad transfer leaves this
        worker's state as it was. Then the optimizer, each registered object (its
        ``load_state_dict``, in the order of registration; each tensor on the device of the
        object's own tensor at that place), the model, the counters and the RNG states are loaded.
        CPU tensors of the model and the optimizer are adopted as views of
        ``flat`` (no copy), so ``flat`` becomes this state's arena and must not be written to
        afterwards; registered objects are given copies.

        Raises:
            ModelMismatch: the peer's model tensors differ in name, dtype or shape from ours, or it
                registered other objects (by name) than this worker.
            StateCorrupt: the layout is malformed or does not fit the buffer, or a registered
                object's ``load_state_dict`` refused its state (the optimizer and the objects
                loaded before it get their previous state back: nothing changed).
        """
        try:
            d = self._decode(layout_bytes, flat)
        except (*_LOAD_ERRORS, RecursionError) as exc:
            raise StateCorrupt(f"state from rank 0 is malformed: {type(exc).__name__}: {exc}") from exc
        # Loading is all or nothing: a load_state_dict that refuses half-way restores what was there.
        saved: list[tuple[Any, object]] = [(self.optimizer, copy.deepcopy(self.optimizer.state_dict()))]
        saved += [(obj, copy.deepcopy(obj.state_dict())) for obj in self._extras.values()]
        before = {id(obj): sd for obj, sd in saved}
        try:
            try:
                self.optimizer.load_state_dict(d.optim_sd)  # validates groups before changing anything
            except (ValueError, TypeError, KeyError) as exc:
                raise StateCorrupt(f"optimizer state from rank 0 does not fit this optimizer: {exc}") from exc
            for name, value in d.extras.items():
                try:
                    self._extras[name].load_state_dict(like_devices(value, before[id(self._extras[name])]))
                except _LOAD_ERRORS as exc:
                    raise StateCorrupt(
                        f"{_label(name, self._extras[name])} refused the state being loaded: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
        except StateCorrupt:
            for obj, sd in saved:
                try:
                    obj.load_state_dict(sd)
                except _LOAD_ERRORS as exc:  # an object that refuses its own state: say so, go on
                    log.error("state_restore_failed", object=type(_user_object(obj)).__qualname__, error=str(exc)[:200])
            raise
        ours = self.model.state_dict()
        for name, t in d.model_sd.items():
            if is_dtensor(ours[name]):  # its local shard, in place (FSDP2 owns the storage)
                with torch.no_grad():
                    ours[name].to_local().copy_(t)
            elif ours[name].device == t.device:
                self._adopt(f"model.{name}", t, [])
            else:
                ours[name].copy_(t)
        self.counters = d.counters
        self.loads += 1
        torch.set_rng_state(d.rng)
        self.device_rng.load(d.device_rngs)
        if flat.device.type == "cpu" and flat.storage_offset() % _ALIGN == 0:
            self._arena, self._arena_key, self._arena_entries = flat, d.arena_key, d.entries
            self._received_key = d.key
        else:
            self._received_key = None

    def _decode(self, layout_bytes: bytes, flat: torch.Tensor) -> _Decoded:
        layout = json.loads(layout_bytes)
        if not isinstance(layout, dict):
            raise TypeError("the layout is not a JSON object")
        entries = layout["tensors"]
        total = int(layout["total"])
        groups = decode(layout["param_groups"], {})
        trees = layout.get("extras", {})  # none in checkpoints written before objects could be registered
        if not isinstance(entries, list) or not isinstance(groups, list) or not isinstance(trees, dict):
            raise TypeError("tensors and param_groups must be lists, extras an object")
        if not 0 <= total <= flat.numel():
            raise ValueError(f"total {total} does not fit a buffer of {flat.numel()} bytes")
        ours = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        model_sd: dict[str, torch.Tensor] = {}
        optim_state: dict[int, dict[str, object]] = {}
        extra_tensors: dict[str, dict[str, torch.Tensor]] = {}
        counters: Counters | None = None
        for entry in entries:
            name, dtype_s, shape, offset, nbytes = entry
            if dtype_s not in _DTYPES:
                raise ValueError(f"unknown dtype {dtype_s!r}")
            dtype = _DTYPES[dtype_s]
            numel = math.prod(int(d) for d in shape)
            if nbytes != numel * dtype.itemsize or offset < 0 or offset + nbytes > total:
                raise ValueError(f"entry {name} does not fit: {shape} {dtype_s} at {offset}+{nbytes}")
            raw = flat[offset : offset + nbytes]
            if (flat.storage_offset() + offset) % dtype.itemsize:
                raw = raw.clone()  # a fresh storage is aligned for any dtype
            t = raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
            if name.startswith("model."):
                mine = local_shard(ours[name]) if name in ours else None
                if mine is None or mine.shape != t.shape or mine.dtype != t.dtype:
                    raise ModelMismatch(f"state tensor {name} {dtype_s}{shape} does not match this worker's model")
                model_sd[name[len("model.") :]] = t
            elif name.startswith("optim."):
                _, idx, key = name.split(".", 2)
                optim_state.setdefault(int(idx), {})[key] = t
            elif name.startswith("extra."):
                _, owner, path = name.split(".", 2)
                extra_tensors.setdefault(owner, {})[path] = t.clone()  # copied: the object keeps its own
            elif name == "counters":
                counters = Counters(*[int(x) for x in t.tolist()])
        if set(model_sd) != {k[len("model.") :] for k in ours}:
            raise ModelMismatch("the state from rank 0 has a different set of model tensors")
        if set(trees) != set(self._extras) or not set(extra_tensors) <= set(trees):
            raise ModelMismatch(
                f"the state being loaded holds the registered objects {sorted(trees)}, and this worker "
                f"registered {sorted(self._extras)}: every worker must register the same objects under the "
                f"same names (register) before it syncs or loads a checkpoint"
            )
        if counters is None:
            raise KeyError("counters")
        _check_groups(groups, self.optimizer, "optimizer")
        scalars = decode(layout.get("optim_scalars", {}), {})
        if not isinstance(scalars, dict):
            raise TypeError("optim_scalars must be an object")
        for key, value in scalars.items():
            idx, name = key.split(".", 1)
            optim_state.setdefault(int(idx), {})[name] = value
        extras: dict[str, object] = {}
        for name, obj in self._extras.items():
            extras[name] = decode(trees[name], extra_tensors.get(name, {}))
            if isinstance(obj, torch.optim.Optimizer):  # checked now, so it cannot fail half-way through loading
                sd = extras[name]
                if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list):
                    raise TypeError(f"registered optimizer {name!r}: a state dict without param_groups")
                _check_groups(sd["param_groups"], obj, f"registered optimizer {name!r}")
        rng, device_rngs = split_rng_states(layout, flat, total)
        return _Decoded(
            model_sd,
            {"state": _shard_like_params(optim_state, self.optimizer), "param_groups": groups},
            extras,
            counters,
            rng,
            device_rngs,
            entries,
            json.dumps([entries, [rng.numel(), *(r.numel() for r in device_rngs)]]),
            checksum_key(layout),
        )


class ChecksumAhead:
    """``state.checksum()`` computed on a daemon thread (XXH3 releases the GIL while it hashes), for
    ``sync_state``'s ``own_checksum``: a survivor hashes its state while it rendezvouses instead of
    on the state transfer's critical path. The caller must not change the state until it has taken
    ``result``."""

    def __init__(self, state: TrainingState) -> None:
        self._value: int | None = None
        self._thread = threading.Thread(target=self._run, args=(state,), name="elasticd-checksum", daemon=True)
        self._thread.start()

    def _run(self, state: TrainingState) -> None:
        try:
            self._value = state.checksum()
        except (RuntimeError, ValueError, TypeError, ConfigError) as exc:  # sync_state hashes anew and meets it again
            log.warning("checksum_ahead_failed", error=str(exc)[:200])

    def result(self, deadline: Deadline) -> int | None:
        """The checksum, or None if it failed or is not done by ``deadline``."""
        self._thread.join(deadline.remaining_s())
        return None if self._thread.is_alive() else self._value


def _as_stateful(name: str, obj: object, label: str) -> _Stateful:
    """``obj`` itself if it has ``state_dict``/``load_state_dict``; plain data in a dict, a list or
    a tensor wrapped in a ``_PlainValue``.

    Raises:
        ConfigError: ``obj`` has only one of the two methods, or none and is no such container (an
            immutable value, which cannot be updated in place, is told so).
    """
    methods = [m for m in ("state_dict", "load_state_dict") if callable(getattr(obj, m, None))]
    if len(methods) == 2:
        return cast(_Stateful, obj)
    if methods:
        missing = "load_state_dict" if methods == ["state_dict"] else "state_dict"
        raise ConfigError(
            f"{label} has no {missing}() method: only objects with state_dict() and "
            f"load_state_dict(state_dict), or plain data, can be registered"
        )
    if isinstance(obj, (dict, torch.Tensor)) or type(obj) is list:
        return _PlainValue(obj)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, tuple)):
        raise ConfigError(
            f"ElasticTrainer.register / ElasticTrainer(state=...): {name!r} is {_a(obj)}"
            f"{'' if obj is None else f' ({reprlib.repr(obj)})'}, which cannot be updated in place: a newcomer or a checkpoint loads its state into the very "
            f"object registered, and your reference to {_a(obj)} would never see it. Register a dict or a "
            f"list that holds it, e.g. {reprlib.repr({name: obj})}, and read the value from there"
        )
    raise ConfigError(
        f"{label} has no state_dict() method: only objects with state_dict() and load_state_dict(state_dict) "
        f"can be registered, or plain data, updated in place: a dict, a list or a tensor built of tensors, "
        f"numbers, strings, bools, None and nested dicts and lists (an EMA as {{name: tensor}}, counters "
        f"as {{'tokens': 0}})"
    )


def _a(obj: object) -> str:
    """``obj``'s type with its article: "an int", "a str", "None"."""
    if obj is None:
        return "None"
    kind = type(obj).__qualname__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def _user_object(obj: _Stateful) -> object:
    """What the caller registered: the plain value a ``_PlainValue`` wraps, or the object itself."""
    return obj.value if isinstance(obj, _PlainValue) else obj


def _label(name: str, obj: _Stateful) -> str:
    """How error messages name a registered object or plain value."""
    what = "value" if isinstance(obj, _PlainValue) else "object"
    return f"registered {what} {name!r} ({type(_user_object(obj)).__qualname__})"


def _encode_registered(name: str, obj: _Stateful) -> tuple[JsonValue, list[tuple[str, torch.Tensor]]]:
    """``extras.encode`` of a registered object's state dict (a plain value: the value itself).

    Raises:
        ConfigError: see ``_encode_checked``; the message names the object and the path.
    """
    hint = _PLAIN_HINT if isinstance(obj, _PlainValue) else STATE_DICT_HINT
    return _encode_checked(obj.state_dict(), _label(name, obj), hint)


def _encode_checked(value: object, label: str, hint: str) -> tuple[JsonValue, list[tuple[str, torch.Tensor]]]:
    """``extras.encode``, and every tensor one the arena can hold.

    Raises:
        ConfigError: see ``extras.encode``; or a tensor of a dtype or layout the arena cannot hold.
    """
    tree, tensors = encode(value, label, hint)
    for path, t in tensors:
        if str(t.dtype) not in _DTYPES or t.layout != torch.strided or t.device.type == "meta":
            raise ConfigError(
                f"{label}: the tensor at {path} is a {t.layout} {t.dtype} tensor on {t.device}; "
                f"the state holds dense tensors of {sorted(_DTYPES)} with data"
            )
    return tree, tensors


def _check_groups(groups: object, optimizer: torch.optim.Optimizer, what: str) -> None:
    if (
        not isinstance(groups, list)
        or len(groups) != len(optimizer.param_groups)
        or any(
            not isinstance(g, dict) or len(g["params"]) != len(mine["params"])
            for g, mine in zip(groups, optimizer.param_groups)
        )
    ):
        raise ValueError(f"{what} param groups differ from this worker's")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a sharded tensor (FSDP2's ``DTensor``). A process that never imported
    ``torch.distributed.tensor`` (data-parallel training) holds none: it is not imported here
    (over a second of a worker's start, most of its import of elasticd)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor's local shard; any other tensor itself."""
    return cast(Any, t).to_local() if is_dtensor(t) else t


def _shard_like_params(
    optim_state: dict[int, dict[str, object]], optimizer: torch.optim.Optimizer
) -> dict[int, dict[str, object]]:
    """``optim_state``, where a parameter is sharded (a DTensor) with its optimizer state tensors
    of the parameter's local shape (moments; not a scalar step) made DTensors sharded as it is,
    each over a copy of its own: a DTensor over a view of the received buffer cannot be deep-copied,
    and the next ``unpack`` deep-copies the optimizer's state to restore it if loading fails."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for idx, st in optim_state.items():
        p = params[idx] if 0 <= idx < len(params) else None
        if not is_dtensor(p):
            continue
        from torch.distributed.tensor import DTensor  # loaded: ``p`` is one

        shape = p.to_local().shape
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape:
                st[key] = DTensor.from_local(
                    value.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
    return optim_state


def model_signature(model: torch.nn.Module) -> str:
    """Names, dtypes and shapes of the model's state: two workers can share state iff equal."""
    desc = [(k, str(v.dtype), list(v.shape)) for k, v in model.state_dict().items()]
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
