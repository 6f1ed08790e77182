"""The faithful, pickle-free encoding of a state dict: its tensors apart, every other value as strict JSON.

Owns ``encode`` (a registered object's ``state_dict()``, or any part of the training state that is
not a tensor, to a strict-JSON tree in which each tensor is replaced by a reference to its path,
plus those tensors by path) and ``decode`` (the tree and the tensors back to an equal value), and
the tags by which the tree says what JSON cannot:

=====================================================  =============================================
value                                                  in the tree
=====================================================  =============================================
str, int, finite float, bool, None                     itself (JSON keeps ``1``, ``1.0``, ``true`` apart)
float nan, inf, -inf                                   ``{"$float": "nan"}`` (``"inf"``, ``"-inf"``)
list                                                   a list
tuple                                                  ``{"$tuple": [...]}``
dict whose keys are all str, none starting with "$"    an object
any other dict (int keys: an optimizer's state)        ``{"$dict": [[key, value], ...]}``, in order
tensor                                                 ``{"$tensor": "<path>"}``
=====================================================  =============================================

Subclasses of int, float, str and dict (an ``OrderedDict``) decode as the built-in type; subclasses
of list and tuple (a namedtuple) are refused, as is every other value (a function, a lambda, an
arbitrary object): its state could not travel without pickling, and elasticd never pickles.
Owns ``load_in_place`` too: a decoded state into a registered plain value (a dict, a list or a
tensor the user keeps a reference to), updating it in place. Never lays a tensor out anywhere
(``state`` lays them out in its arena), never touches a file or a peer, and never executes anything
it decodes.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import TypeAlias

import torch

from elasticd.errors import ConfigError

JsonValue: TypeAlias = "None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]"

TENSOR, TUPLE, FLOAT, DICT = "$tensor", "$tuple", "$float", "$dict"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
ROOT = "_"  # the path of a state dict that is itself a tensor
_PATH_SEP = "."
STATE_DICT_HINT = "Return plain data from state_dict()"  # what to do about a value that is not plain data


def encode(value: object, label: str, hint: str = STATE_DICT_HINT) -> tuple[JsonValue, list[tuple[str, torch.Tensor]]]:
    """The strict-JSON tree of ``value`` and its tensors, as (path, tensor) in the order met.

    A tensor's path joins the keys and indices that lead to it with "." (``state.0.exp_avg``);
    paths are unique (a clash, like the keys ``0`` and ``"0"``, gets a ``~2`` suffix).

    Args:
        label: names the owner of ``value`` in error messages ("registered object 'ema' (EMA)").
        hint: the last sentence of the message about a value that is not plain data: what to do.

    Raises:
        ConfigError: ``value`` holds something that is neither a tensor nor plain data (the message
            names ``label`` and the path of that value), or refers to itself.
    """
    enc = _Encoder(label, hint)
    return enc.value(value, ()), enc.tensors


def decode(tree: object, tensors: Mapping[str, torch.Tensor]) -> object:
    """The value that ``encode`` turned into ``tree`` and ``tensors`` (by path).

    Raises:
        ValueError: ``tree`` is not such a tree (an unknown tag, a malformed one, a dict key that
            cannot be one), or it refers to a tensor that ``tensors`` lacks, or to one twice, or
            ``tensors`` holds one it does not refer to.
    """
    used: set[str] = set()
    value = _decode(tree, tensors, used, keys_only=False)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"tensors {unused[:4]} are not referred to by the state")
    return value


def _describe(path: tuple[str, ...]) -> str:
    return _PATH_SEP.join(path) if path else "(the state dict itself)"


class _Encoder:
    def __init__(self, label: str, hint: str) -> None:
        self.label, self.hint = label, hint
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._paths: set[str] = set()
        self._open: set[int] = set()  # the containers on the way down: a cycle would never end

    def value(self, v: object, path: tuple[str, ...], key: bool = False) -> JsonValue:
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            f = float(v)
            if math.isfinite(f):
                return f
            return {FLOAT: "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")}
        if isinstance(v, str):
            return str(v)
        if isinstance(v, torch.Tensor):
            if key:
                raise ConfigError(f"{self.label}: a tensor is a dict key at {_describe(path)}; keys must be plain data")
            return {TENSOR: self._tensor_path(path, v)}
        if type(v) in (list, tuple) or isinstance(v, dict):
            if id(v) in self._open:
                raise ConfigError(f"{self.label}: the state dict refers to itself at {_describe(path)}")
            self._open.add(id(v))
            try:
                return self._container(v, path, key)
            finally:
                self._open.discard(id(v))
        raise ConfigError(
            f"{self.label}: the value at {_describe(path)} is a {type(v).__module__}.{type(v).__qualname__} "
            f"({_short(v)}), which is neither a tensor nor plain data (str, int, float, bool, None, and lists, "
            f"tuples and dicts of them); it cannot travel to other workers or into a checkpoint without "
            f"pickling, which elasticd never does. {self.hint}"
        )

    def _container(self, v: object, path: tuple[str, ...], key: bool) -> JsonValue:
        if isinstance(v, list):
            return [self.value(x, (*path, str(i)), key) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {TUPLE: [self.value(x, (*path, str(i)), key) for i, x in enumerate(v)]}
        assert isinstance(v, dict)
        if key:
            raise ConfigError(f"{self.label}: a dict is a dict key at {_describe(path)}")
        if all(isinstance(k, str) and not k.startswith("$") for k in v):
            return {str(k): self.value(x, (*path, str(k))) for k, x in v.items()}
        pairs: list[JsonValue] = []
        for k, x in v.items():
            step = str(k) if isinstance(k, str) else repr(k)
            pairs.append([self.value(k, (*path, step), key=True), self.value(x, (*path, step))])
        return {DICT: pairs}

    def _tensor_path(self, path: tuple[str, ...], t: torch.Tensor) -> str:
        name = _PATH_SEP.join(path) if path else ROOT
        unique, n = name, 1
        while unique in self._paths:
            n += 1
            unique = f"{name}~{n}"
        self._paths.add(unique)
        self.tensors.append((unique, t))
        return unique


def _short(v: object) -> str:
    return reprlib.repr(v)  # bounded, and it survives a __repr__ that raises


def _decode(t: object, tensors: Mapping[str, torch.Tensor], used: set[str], keys_only: bool) -> object:
    if t is None or isinstance(t, (bool, int, float, str)):
        return t
    if isinstance(t, list) and not keys_only:
        return [_decode(x, tensors, used, keys_only) for x in t]
    if not isinstance(t, dict):
        raise ValueError(f"a {type(t).__name__} {'as a dict key' if keys_only else 'in a state tree'}")
    tags = [k for k in t if isinstance(k, str) and k.startswith("$")]
    if not tags:
        if keys_only:
            raise ValueError("a dict as a dict key")
        return {k: _decode(x, tensors, used, keys_only) for k, x in t.items()}
    if len(t) != 1:
        raise ValueError(f"a tagged value with more keys: {sorted(t)[:4]}")
    ((tag, body),) = t.items()
    if tag == TUPLE and isinstance(body, list):
        return tuple(_decode(x, tensors, used, keys_only) for x in body)
    if tag == FLOAT and isinstance(body, str) and body in _NONFINITE:
        return _NONFINITE[body]
    if tag == DICT and isinstance(body, list) and not keys_only:
        out: dict[object, object] = {}
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("a $dict entry is not a [key, value] pair")
            k = _decode(pair[0], tensors, used, keys_only=True)  # scalars and tuples of them: hashable
            out[k] = _decode(pair[1], tensors, used, keys_only)
        return out
    if tag == TENSOR and isinstance(body, str) and not keys_only:
        if body not in tensors:
            raise ValueError(f"the state refers to a tensor {body!r} that the layout lacks")
        if body in used:
            raise ValueError(f"the state refers to the tensor {body!r} twice")
        used.add(body)
        return tensors[body]
    raise ValueError(f"a malformed or unknown tag {tag!r} in a state tree")


def like_devices(value: object, live: object) -> object:
    """``value`` (a decoded state) with each tensor moved to the device of the tensor at the same
    place in ``live`` (the object's own state before loading), so that state kept on a GPU comes
    back there from a CPU buffer; where ``live`` has no tensor, the tensor stays where it is."""
    if isinstance(value, torch.Tensor):
        if isinstance(live, torch.Tensor) and live.device != value.device:
            return value.to(live.device)
        return value
    if isinstance(value, dict):
        other = live if isinstance(live, dict) else {}
        return {k: like_devices(v, other.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        seq = live if isinstance(live, (list, tuple)) and len(live) == len(value) else [None] * len(value)
        out = [like_devices(v, w) for v, w in zip(value, seq, strict=True)]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def load_in_place(live: object, value: object) -> None:
    """Load ``value`` (a decoded state) into ``live`` (a registered plain value: a dict, a list or a
    tensor) in place, so that every reference to ``live`` sees it.

    A tensor of ``live`` is overwritten (``copy_``; the one at that place in ``value`` must be a
    tensor of the same shape and dtype), a dict or a list of ``live`` keeps its identity and takes
    the entries of ``value`` (``clear``/``update``, slice assignment; the tensors and containers in
    it are loaded in place the same way, entries ``value`` adds are inserted, entries it lacks are
    removed), and every other value (a number, a string, None, a tuple) is replaced. Everything is
    checked before anything changes.

    Raises:
        ValueError: ``value`` does not fit ``live``: a tensor of another shape or dtype, or another
            kind of value where ``live`` holds a tensor, a dict or a list (the message names the path).
    """
    _check_fits(live, value, ())
    _assign(live, value)


def _updated_in_place(v: object) -> bool:
    return isinstance(v, (torch.Tensor, dict)) or type(v) is list


def _kind(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {list(v.shape)}"
    return f"a {type(v).__qualname__}"


def _check_fits(live: object, value: object, path: tuple[str, ...]) -> None:
    if isinstance(live, torch.Tensor):
        fits = isinstance(value, torch.Tensor) and value.shape == live.shape and value.dtype == live.dtype
    else:
        fits = isinstance(value, dict) if isinstance(live, dict) else isinstance(value, list)
    if not fits:
        raise ValueError(
            f"the state being loaded holds {_kind(value)} at {_describe(path)}, where the registered "
            f"value holds {_kind(live)}"
        )
    if isinstance(live, dict):
        assert isinstance(value, dict)
        for k, v in value.items():
            if k in live and _updated_in_place(live[k]):
                _check_fits(live[k], v, (*path, str(k)))
    elif isinstance(live, list):
        assert isinstance(value, list)
        for i, (mine, v) in enumerate(zip(live, value)):
            if _updated_in_place(mine):
                _check_fits(mine, v, (*path, str(i)))


def _assign(live: object, value: object) -> object:
    """``live`` holding ``value`` (checked by ``_check_fits``); the new entries are built before
    ``live`` changes, so ``value`` may share parts with it."""
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(value)  # type: ignore[arg-type]
    elif isinstance(live, dict):
        entries = {k: _assign(live[k], v) if k in live and _updated_in_place(live[k]) else v for k, v in value.items()}  # type: ignore[attr-defined]
        live.clear()
        live.update(entries)
    elif isinstance(live, list):
        items = [
            _assign(live[i], v) if i < len(live) and _updated_in_place(live[i]) else v for i, v in enumerate(value)
        ]  # type: ignore[arg-type]
        live[:] = items
    return live
