"""Plain values registered as they are (an EMA kept as ``{name: tensor}``, a list of tensors, a dict of
counters): their state travels through pack/unpack and a durable checkpoint, is checksummed, and is
loaded into the caller's very object; what cannot be updated in place or cannot travel is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elasticd import ElasticTrainer
from elasticd.errors import ConfigError, StateCorrupt
from elasticd.worker.state.durable import CheckpointWriter, load_latest
from elasticd.worker.state.extras import load_in_place
from elasticd.worker.state.training import TrainingState
from tests.unit.test_checkpoint import make_state, train
from tests.unit.test_state_extras import same

pytestmark = pytest.mark.timeout(60)


def _ema(state: TrainingState) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.model.state_dict().items() if v.is_floating_point()}


# Each maker builds a plain value from a state's model and a seed: equal seeds, equal values.
PLAIN: dict[str, Callable[[TrainingState, int], object]] = {
    "ema_dict": lambda s, seed: {k: v + seed for k, v in _ema(s).items()},
    "list_of_tensors": lambda s, seed: [torch.full((3,), float(seed)), torch.arange(4) * seed],
    "counters": lambda s, seed: {"tokens": 100 * seed, "samples": seed, "best": 1.0 / (seed + 1), "tag": f"s{seed}"},
    "nested": lambda s, seed: {
        "ema": {"w": torch.full((2, 2), float(seed))},
        "hist": [seed, 2.5, None, True, "x"],
        "by_step": {seed: (seed, 0.5)},
        "deep": [{"t": torch.ones(2) * seed, "n": seed}],
    },
    "tensor": lambda s, seed: torch.full((5,), float(seed), dtype=torch.float64),
}


def _tensors_of(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensors_of(v)]
    return []


def _containers_of(value: object) -> list[object]:
    if isinstance(value, dict):
        return [value, *(c for v in value.values() for c in _containers_of(v))]
    if isinstance(value, list):
        return [value, *(c for v in value for c in _containers_of(v))]
    return []


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_value_round_trips_into_the_callers_own_object(make: Callable[[TrainingState, int], object]) -> None:
    src, dst = make_state(1), make_state(2)
    train(src, 2)
    mine, theirs = make(dst, 2), make(src, 7)
    src.register("value", theirs)
    dst.register("value", mine)
    tensors, containers = _tensors_of(mine), _containers_of(mine)
    assert src.checksum() != dst.checksum()
    layout, flat = src.pack()
    dst.unpack(layout, flat.clone())
    assert same(mine, theirs)  # the caller's reference sees the state loaded
    assert dst.registered()["value"] is mine
    assert [id(t) for t in _tensors_of(mine)] == [id(t) for t in tensors]  # loaded by copy_, not replaced
    assert [id(c) for c in _containers_of(mine)] == [id(c) for c in containers]
    assert all(a is not b for a, b in zip(_tensors_of(mine), _tensors_of(theirs)))  # copies, not the peer's
    assert dst.checksum() == src.checksum()


def test_entries_the_loaded_state_adds_or_lacks_are_inserted_and_removed_in_place() -> None:
    src, dst = make_state(1), make_state(2)
    src.register("counters", {"tokens": 7, "new": [1, 2]})
    mine: dict[str, object] = {"tokens": 0, "old": "gone"}
    dst.register("counters", mine)
    layout, flat = src.pack()
    dst.unpack(layout, flat.clone())
    assert mine == {"tokens": 7, "new": [1, 2]}
    assert list(mine) == ["tokens", "new"]  # the loaded order


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v["ema"]["w"].add_(1.0),
        lambda v: v.__setitem__("tokens", v["tokens"] + 1),
        lambda v: v["hist"].append(3),
        lambda v: v.__setitem__("extra", None),
    ],
    ids=["a_tensor", "a_counter", "a_list_grows", "a_new_key"],
)
def test_the_checksum_covers_a_plain_value(change: Callable[[dict[str, object]], None]) -> None:
    def value() -> dict[str, object]:
        return {"ema": {"w": torch.zeros(3)}, "tokens": 5, "hist": [1, 2]}

    a, b = make_state(0), make_state(0)
    va, vb = value(), value()
    a.register("plain", va)
    b.register("plain", vb)
    assert a.checksum() == b.checksum()
    change(vb)
    assert a.checksum() != b.checksum()


def test_a_plain_value_persists_in_a_durable_checkpoint(tmp_path: Path) -> None:
    state = make_state(0)
    ema, tokens = _ema(state), {"tokens": 0}
    state.register("ema", ema)
    state.register("tokens", tokens)
    train(state, 3)
    for v in ema.values():
        v.mul_(0.5)
    tokens["tokens"] = 1234
    writer = CheckpointWriter(
        tmp_path, job_id="j", node="n0", signature=state.signature, every_steps=1, every_s=0.0, keep=3, wait_s=10.0
    )
    assert writer.save(state, generation=1)
    assert writer.wait_idle(10)
    writer.close()
    assert writer.failures == 0

    fresh = make_state(5)
    fresh_ema, fresh_tokens = {k: torch.zeros_like(v) for k, v in ema.items()}, {"tokens": 0}
    held = dict(fresh_ema)
    fresh.register("ema", fresh_ema)
    fresh.register("tokens", fresh_tokens)
    loaded = load_latest(tmp_path, fresh)
    assert loaded is not None and loaded.manifest.step == 3
    assert same(fresh_ema, ema) and fresh_tokens == {"tokens": 1234}
    assert all(fresh_ema[k] is held[k] for k in held)
    assert fresh.checksum() == state.checksum() == loaded.manifest.state_checksum


def test_a_tensor_of_another_shape_is_refused_and_nothing_is_loaded() -> None:
    src, dst = make_state(1), make_state(2)
    src.register("ema", {"a": torch.ones(2), "b": torch.ones(3)})
    mine = {"a": torch.zeros(2), "b": torch.zeros(4)}
    dst.register("ema", mine)
    before = dst.checksum()
    layout, flat = src.pack()
    with pytest.raises(
        StateCorrupt,
        match=r"registered value 'ema' \(dict\) refused.* at b, where the registered "
        r"value holds a torch.float32 tensor of shape \[4\]",
    ):
        dst.unpack(layout, flat.clone())
    assert torch.equal(mine["a"], torch.zeros(2)) and dst.checksum() == before


# -- load_in_place, pure ------------------------------------------------------------------------


MISFITS = {  # (live, value) -> a fragment of the message
    "shape": (
        {"w": torch.zeros(2)},
        {"w": torch.zeros(3)},
        "tensor of shape [3] at w, where the registered value holds a torch.float32 tensor of shape [2]",
    ),
    "dtype": ([torch.zeros(2)], [torch.zeros(2, dtype=torch.float64)], "torch.float64 tensor of shape [2] at 0"),
    "not_a_tensor": ({"w": torch.zeros(2)}, {"w": None}, "holds a NoneType at w"),
    "not_a_dict": ({"d": {"x": 1}}, {"d": [1]}, "holds a list at d, where the registered value holds a dict"),
    "top_level": ({"x": 1}, [1], "holds a list at (the state dict itself)"),
    "deep": ({"a": [{"t": torch.zeros(1)}]}, {"a": [{"t": torch.zeros(1, 1)}]}, "at a.0.t"),
}


@pytest.mark.parametrize(("live", "value", "fragment"), MISFITS.values(), ids=MISFITS.keys())
def test_load_in_place_refuses_a_misfit_before_changing_anything(live: object, value: object, fragment: str) -> None:
    if isinstance(live, dict):
        live["first"] = torch.zeros(1)
        if isinstance(value, dict):
            value = {"first": torch.ones(1), **value}  # loaded first, were it not checked first
    with pytest.raises(ValueError) as err:
        load_in_place(live, value)
    assert fragment in str(err.value), err.value
    if isinstance(live, dict):
        assert torch.equal(live["first"], torch.zeros(1))


def test_load_in_place_of_a_value_sharing_parts_with_the_live_one() -> None:
    inner = {"t": torch.ones(2)}
    live = {"a": inner, "n": 1, "l": [1, 2]}
    load_in_place(live, {"a": inner, "n": 2, "l": live["l"]})
    assert live == {"a": inner, "n": 2, "l": [1, 2]} and live["a"] is inner


def test_a_parameter_is_loaded_in_place_without_autograd_complaining() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    load_in_place({"p": p}, {"p": torch.ones(3)})
    assert torch.equal(p.detach(), torch.ones(3)) and p.requires_grad


# -- refusals at registration ---------------------------------------------------------------------


IMMUTABLE = {  # value -> its description in the message
    "int": (0, "'count' is an int (0), which cannot be updated in place"),
    "float": (1.5, "'count' is a float (1.5), which cannot be updated in place"),
    "str": ("x", "'count' is a str ('x'), which cannot be updated in place"),
    "bool": (True, "'count' is a bool (True), which cannot be updated in place"),
    "none": (None, "'count' is None, which cannot be updated in place"),
    "tuple": ((1, 2), "'count' is a tuple ((1, 2)), which cannot be updated in place"),
}


@pytest.mark.parametrize(("value", "fragment"), IMMUTABLE.values(), ids=IMMUTABLE.keys())
def test_an_immutable_value_is_refused_with_a_wrapper_suggested(value: object, fragment: str) -> None:
    state = make_state(0)
    with pytest.raises(ConfigError) as err:
        state.register("count", value)
    message = str(err.value)
    assert message.startswith("ElasticTrainer.register / ElasticTrainer(state=...): ")
    assert fragment in message and f"e.g. {{'count': {value!r}}}" in message, message
    assert state.registered() == {}


class _NotPlain:
    pass


class _ListSubclass(list):  # type: ignore[type-arg]
    pass


REFUSED = {  # value -> a fragment of the message
    "an_object": (_NotPlain(), "registered object 'x' (_NotPlain) has no state_dict() method"),
    "a_list_subclass": (_ListSubclass(), "registered object 'x' (_ListSubclass) has no state_dict() method"),
    "an_object_inside": ({"a": {"b": [1, _NotPlain()]}}, "registered value 'x' (dict): the value at a.b.1 is a "),
    "a_function_inside": ([torch.ones(1), print], "registered value 'x' (list): the value at 1 is a "),
    "a_complex_tensor_inside": ({"z": torch.zeros(2, dtype=torch.complex64)}, "the tensor at z"),
    "a_cycle": ((lambda d: (d.__setitem__("me", d), d)[1])({}), "refers to itself at me"),
}


@pytest.mark.parametrize(("value", "fragment"), REFUSED.values(), ids=REFUSED.keys())
def test_a_value_that_is_not_plain_data_is_refused(value: object, fragment: str) -> None:
    state = make_state(0)
    with pytest.raises(ConfigError) as err:
        state.register("x", value)
    assert fragment in str(err.value), err.value
    assert state.registered() == {}


def test_a_plain_value_inside_names_the_plain_data_hint() -> None:
    state = make_state(0)
    with pytest.raises(ConfigError, match="Keep only tensors and plain data in the registered value"):
        state.register("x", {"bad": object()})


def test_the_same_value_twice_is_refused() -> None:
    state = make_state(0)
    ema = {"w": torch.zeros(1)}
    state.register("ema", ema)
    with pytest.raises(ConfigError, match="registered value 'again' \\(dict\\) is registered already, as 'ema'"):
        state.register("again", ema)
    with pytest.raises(ConfigError, match="the name 'ema' is taken by a dict"):
        state.register("ema", {"other": 1})


def test_the_trainer_takes_plain_values_and_refuses_immutable_ones() -> None:
    model = torch.nn.Linear(2, 2)
    ema = {"w": torch.zeros(2)}
    trainer = ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), state={"ema": ema})
    trainer.register("tokens", {"tokens": 0})
    assert trainer.state.registered() == {"ema": ema, "tokens": {"tokens": 0}}
    assert trainer.state.registered()["ema"] is ema
    trainer.close(clean=False)
    with pytest.raises(ConfigError, match=r"ElasticTrainer\(state=...\): 'count' is an int"):
        ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), state={"count": 0})
