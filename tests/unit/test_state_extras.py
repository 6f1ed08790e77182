"""Registered objects (schedulers, a second optimizer, a GradScaler, user objects) and the CUDA RNG
travel with the training state: the encoding of their state dicts (table-driven), pack/unpack into
a fresh state, the checksum covering all of it, refusals at registration and at unpack."""

from __future__ import annotations

import json
import math
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Sequence

import pytest
import torch

from elasticd.errors import ConfigError, ModelMismatch, StateCorrupt
from elasticd.worker.state.checksum import checksum_key, state_checksum, state_hasher
from elasticd.worker.state.durable_format import legacy_checksum_key
from elasticd.worker.state.extras import decode, encode
from elasticd.worker.state.rng import CudaRng
from elasticd.worker.state.training import TrainingState
from tests.unit.test_checkpoint import make_model

pytestmark = pytest.mark.timeout(60)


# -- the encoding, pure ---------------------------------------------------------------------------


def same(a: object, b: object) -> bool:
    """Equal values of equal types all the way down (tensors by dtype, shape and bytes; nan == nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        assert isinstance(b, float)
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def through_json(value: object) -> object:
    """``value`` encoded, sent as strict JSON, decoded (its tensors travel beside the JSON, cloned)."""
    tree, tensors = encode(value, "test")
    wire = json.dumps(tree, allow_nan=False)
    return decode(json.loads(wire), {path: t.clone() for path, t in tensors})


ROUND_TRIPS = {
    "scalars": {"i": 3, "f": 3.0, "neg_zero": -0.0, "b": True, "zero_false": [0, False, 0.0], "none": None, "s": "x"},
    "non_finite": {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "in_list": [math.nan, 1.5]},
    "int_keys": {"state": {0: {"step": 3, "buf": None}, 7: {}}, "param_groups": [{"params": [0, 7]}]},
    "mixed_keys": {1: "int", "1": "str", False: "bool", None: "none", 2.5: "float", (1, "a"): "tuple"},
    "dollar_keys": {"$tensor": "not a tensor", "$tuple": [1]},
    "tuples": {"betas": (0.9, 0.999), "nested": ((1, 2), [3, (4,)]), "empty": ()},
    "empties": {"d": {}, "l": [], "s": ""},
    "ordered": OrderedDict([("b", 1), ("a", 2)]),
    "tensors": {
        "f32": torch.randn(3, 2),
        "f16": torch.randn(4).half(),
        "bf16": torch.randn(2).bfloat16(),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False]),
        "u8": torch.arange(3, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "by_int": {0: torch.ones(2)},
    },
    "colliding_paths": {
        0: torch.zeros(1),
        "0": torch.ones(1),
        "a.b": torch.full((1,), 2.0),
        "a": {"b": torch.full((1,), 3.0)},
    },
    "tensor_at_root": torch.arange(4, dtype=torch.int32),
    "plain_value": 42,
}


@pytest.mark.parametrize("value", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip(value: object) -> None:
    back = through_json(value)
    expected = dict(value) if type(value) is OrderedDict else value  # dict subclasses decode as dict
    assert same(back, expected), (back, value)


def test_decoded_tensors_are_the_ones_given() -> None:
    t = torch.arange(3)
    tree, tensors = encode({"x": [t]}, "test")
    assert tensors == [("x.0", t)] and tree == {"x": [{"$tensor": "x.0"}]}
    given = {"x.0": torch.arange(3) * 2}
    assert decode(tree, given) == {"x": [given["x.0"]]}


ENCODINGS = [  # (value, the tree)
    ((1, 2), {"$tuple": [1, 2]}),
    ({0: "a"}, {"$dict": [[0, "a"]]}),
    ({"a": 1, 2: 3}, {"$dict": [["a", 1], [2, 3]]}),
    ({"$x": 1}, {"$dict": [["$x", 1]]}),
    ({(0, 1): None}, {"$dict": [[{"$tuple": [0, 1]}, None]]}),
    (math.nan, {"$float": "nan"}),
    ([math.inf, -math.inf], [{"$float": "inf"}, {"$float": "-inf"}]),
    (True, True),
    (1.0, 1.0),
    ({"lr": 0.1, "params": [0, 1]}, {"lr": 0.1, "params": [0, 1]}),  # plain data stays readable
]


@pytest.mark.parametrize(("value", "tree"), ENCODINGS, ids=[repr(v) for v, _ in ENCODINGS])
def test_encoding(value: object, tree: object) -> None:
    assert encode(value, "test") == (tree, [])


Pair = namedtuple("Pair", "a b")


class _Opaque:
    pass


def _cycle() -> dict[str, object]:
    d: dict[str, object] = {"a": 1}
    d["self"] = d
    return d


UNENCODABLE = {  # value -> a fragment of the message (the path of the bad value, or what is wrong)
    "lambda": ({"lr_lambdas": [{"fn": lambda e: 1.0}]}, "lr_lambdas.0.fn"),
    "object": ({"x": [1, _Opaque()]}, "x.1"),
    "namedtuple": ({"p": Pair(1, 2)}, "p"),
    "set": ({"s": {1, 2}}, "s"),
    "bytes": ({0: {"raw": b"x"}}, "0.raw"),
    "complex": ([1j], "0"),
    "tensor_key": ({torch.ones(1): 1}, "a tensor is a dict key"),
    "cycle": (_cycle(), "refers to itself at self"),
    "root": (object(), "(the state dict itself)"),
}


@pytest.mark.parametrize(("value", "fragment"), UNENCODABLE.values(), ids=UNENCODABLE.keys())
def test_a_value_that_is_not_plain_data_is_refused(value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        encode(value, "registered object 'x' (Thing)")
    assert fragment in str(err.value) and "registered object 'x'" in str(err.value)


MALFORMED = {
    "unknown_tag": ({"$pickle": "..."}, {}),
    "tag_and_keys": ({"$tuple": [1], "x": 2}, {}),
    "tuple_not_a_list": ({"$tuple": 1}, {}),
    "bad_float": ({"$float": "NaN"}, {}),
    "missing_tensor": ({"$tensor": "a"}, {}),
    "tensor_twice": ([{"$tensor": "a"}, {"$tensor": "a"}], {"a": torch.ones(1)}),
    "unused_tensor": ({"x": 1}, {"a": torch.ones(1)}),
    "dict_pair": ({"$dict": [[1]]}, {}),
    "list_key": ({"$dict": [[[1], 2]]}, {}),
    "tensor_key": ({"$dict": [[{"$tensor": "a"}, 2]]}, {"a": torch.ones(1)}),
}


@pytest.mark.parametrize(("tree", "tensors"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_tree_is_refused(tree: object, tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError):
        decode(tree, tensors)


# -- a training state with registered objects -------------------------------------------------------


class Ema:
    """A user's object: an exponential moving average of some weights, with plain counters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items() if v.is_floating_point()}
        self.updates = 0
        self.best = math.inf
        self.history: dict[int, tuple[int, float]] = {}

    def update(self, model: torch.nn.Module, loss: float) -> None:
        self.updates += 1
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].mul_(0.9).add_(v.float(), alpha=0.1)
        self.best = min(self.best, loss)
        self.history[self.updates] = (self.updates, loss)

    def state_dict(self) -> dict[str, object]:
        return {"shadow": self.shadow, "updates": self.updates, "best": self.best, "history": self.history}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.shadow = sd["shadow"]  # type: ignore[assignment]
        self.updates, self.best, self.history = sd["updates"], sd["best"], sd["history"]  # type: ignore[assignment]


class TokenCounter:
    def __init__(self) -> None:
        self.tokens = 0

    def state_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.tokens = sd["tokens"]


class Rig:
    """A model trained by SGD (its body) and Adam (its head), each with a scheduler, a GradScaler,
    an EMA and a token counter, all registered."""

    def __init__(
        self, seed: int, register: Sequence[str] = ("adam", "warmup_cosine", "plateau", "scaler", "ema", "tokens")
    ) -> None:
        self.model = make_model(seed)
        body = [p for n, p in self.model.named_parameters() if not n.startswith("3.")]
        self.sgd = torch.optim.SGD(body, lr=0.1, momentum=0.9)
        self.adam = torch.optim.Adam(self.model[3].parameters(), lr=0.01, betas=(0.8, 0.99))  # type: ignore[index]
        warmup = torch.optim.lr_scheduler.LinearLR(self.sgd, start_factor=0.1, total_iters=2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(self.sgd, T_max=10)
        self.sched = torch.optim.lr_scheduler.SequentialLR(self.sgd, [warmup, cosine], milestones=[2])
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.adam, patience=0)  # inf in its state
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        self.ema = Ema(self.model)
        self.tokens = TokenCounter()
        self.state = TrainingState(self.model, self.sgd)
        objects = {
            "adam": self.adam,
            "warmup_cosine": self.sched,
            "plateau": self.plateau,
            "scaler": self.scaler,
            "ema": self.ema,
            "tokens": self.tokens,
        }
        for name in register:
            self.state.register(name, objects[name])

    def train(self, steps: int, seed: int = 100) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)
            self.sgd.zero_grad()
            self.adam.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.sgd)
            self.scaler.step(self.adam)
            self.scaler.update()
            self.sched.step()
            self.plateau.step(loss.item())
            self.ema.update(self.model, loss.item())
            self.tokens.tokens += 6 * 4
            self.state.counters.step += 1

    def objects(self) -> dict[str, object]:
        return {
            "sgd": self.sgd,
            "adam": self.adam,
            "warmup_cosine": self.sched,
            "plateau": self.plateau,
            "scaler": self.scaler,
            "ema": self.ema,
            "tokens": self.tokens,
        }


def state_dicts(rig: Rig) -> dict[str, object]:
    out: dict[str, object] = {k: o.state_dict() for k, o in rig.objects().items()}  # type: ignore[attr-defined]
    out["model"] = dict(rig.model.state_dict())
    return out


def test_round_trip_into_a_fresh_state_and_training_goes_on_identically() -> None:
    src, dst = Rig(1), Rig(2)
    src.train(3)
    assert state_dicts(src)["plateau"]["best"] < math.inf  # type: ignore[index]
    assert src.state.checksum() != dst.state.checksum()
    layout, flat = src.state.pack()
    json.loads(layout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    dst.state.unpack(layout, flat.clone())
    assert same(state_dicts(dst), state_dicts(src))
    assert dst.state.checksum() == src.state.checksum()
    assert dst.ema.shadow["0.weight"] is not src.ema.shadow["0.weight"]
    src.train(2, seed=7)
    dst.train(2, seed=7)
    assert same(state_dicts(dst), state_dicts(src))
    assert dst.state.checksum() == src.state.checksum()


def test_registered_tensors_are_copied_not_adopted() -> None:
    src, dst = Rig(1), Rig(2)
    src.train(1)
    layout, flat = src.state.pack()
    received = flat.clone()
    dst.state.unpack(layout, received)
    region = (received.data_ptr(), received.data_ptr() + received.numel())
    held = [*dst.ema.shadow.values(), *(t for st in dst.adam.state.values() for t in st.values())]
    assert held and all(not region[0] <= t.data_ptr() < region[1] for t in held)
    assert region[0] <= next(dst.model.parameters()).data_ptr() < region[1]  # the model's are adopted


@pytest.mark.parametrize("touch", ["nothing", "ema_tensor", "ema_int"])
def test_streamed_checksum_after_unpack(touch: str) -> None:
    """A receiver's checksum from the bytes as they arrived: valid while the registered objects hold
    what they were given, None once one differs (then the receiver hashes its state anew)."""
    src, dst = Rig(1), Rig(2)
    src.train(2)
    layout, flat = src.state.pack()
    meta = json.loads(layout)
    hasher = state_hasher(checksum_key(meta))
    hasher.update(flat[: meta["total"]].numpy().data)
    dst.state.unpack(layout, flat.clone())
    if touch == "ema_tensor":
        dst.ema.shadow["0.weight"].view(-1)[0] += 1.0
    elif touch == "ema_int":
        dst.ema.updates += 1
    streamed = dst.state.streamed_checksum(hasher)
    assert streamed == (src.state.checksum() if touch == "nothing" else None)


def _only_the_scheduler_steps(rig: Rig) -> None:
    lrs = [g["lr"] for g in rig.sgd.param_groups]
    rig.sched.step()
    for g, lr in zip(rig.sgd.param_groups, lrs):
        g["lr"] = lr  # the optimizer as it was: only the scheduler's own state differs


def _lr(rig: Rig) -> None:
    rig.adam.param_groups[0]["lr"] *= 0.5


def _betas(rig: Rig) -> None:
    rig.adam.param_groups[0]["betas"] = (0.8, 0.98)


def _plateau_best(rig: Rig) -> None:
    rig.plateau.best = rig.plateau.best * 0.5


def _scale(rig: Rig) -> None:
    rig.scaler.update(new_scale=rig.scaler.get_scale() / 2)


def _ema_updates(rig: Rig) -> None:
    rig.ema.updates += 1


def _ema_history_key(rig: Rig) -> None:
    rig.ema.history = {(k + 100 if k == 1 else k): v for k, v in rig.ema.history.items()}


def _ema_tensor(rig: Rig) -> None:
    rig.ema.shadow["0.weight"].view(-1)[0] += 1e-6


def _tokens(rig: Rig) -> None:
    rig.tokens.tokens += 1


def _tuple_vs_list(rig: Rig) -> None:
    rig.ema.history[1] = list(rig.ema.history[1])  # type: ignore[assignment]


@pytest.mark.parametrize(
    "change",
    [
        _only_the_scheduler_steps,
        _lr,
        _betas,
        _plateau_best,
        _scale,
        _ema_updates,
        _ema_history_key,
        _ema_tensor,
        _tokens,
        _tuple_vs_list,
    ],
    ids=[
        "scheduler_only",
        "param_group_lr",
        "betas",
        "plateau_best",
        "grad_scale",
        "ema_int",
        "ema_int_key",
        "ema_tensor",
        "token_count",
        "tuple_vs_list",
    ],
)
def test_checksum_differs_when_any_registered_state_differs(change: Callable[[Rig], None]) -> None:
    a, b = Rig(5), Rig(5)
    a.train(2)
    b.train(2)
    assert a.state.checksum() == b.state.checksum()
    change(b)
    assert a.state.checksum() != b.state.checksum()


def test_a_scheduler_step_escaped_the_old_checksum_and_is_caught_now() -> None:
    """The required case: two states identical but for the scheduler's state (it stepped once more)."""
    a, b = Rig(5, register=["warmup_cosine"]), Rig(5, register=["warmup_cosine"])
    a.train(2)
    b.train(2)
    _only_the_scheduler_steps(b)
    assert a.sched.state_dict() != b.sched.state_dict()
    assert a.state.checksum() != b.state.checksum()

    def legacy(s: TrainingState) -> int:  # what version 2 seeded the hash with: the tensor entries only
        layout, flat = s.pack()
        meta = json.loads(layout)
        return state_checksum(legacy_checksum_key(meta), flat[: meta["total"]].numpy().data, meta["total"])

    assert legacy(a.state) == legacy(b.state)


# -- refusals -------------------------------------------------------------------------------------


class _Callable:
    def __init__(self) -> None:
        self.fn = lambda epoch: 0.95**epoch

    def __call__(self, epoch: int) -> float:
        return self.fn(epoch)


class _NoLoad:
    def state_dict(self) -> dict[str, int]:
        return {}


class _HoldsAnObject:
    def state_dict(self) -> dict[str, object]:
        return {"ok": 1, "nested": {"bad": [object()]}}

    def load_state_dict(self, sd: object) -> None:
        pass


class _ComplexTensor(_HoldsAnObject):
    def state_dict(self) -> dict[str, object]:
        return {"z": torch.zeros(2, dtype=torch.complex64)}


def _other_optimizer(rig: Rig) -> object:
    return torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(rig.model.parameters(), lr=0.1), T_max=3)


REFUSED = {  # (name, object maker) -> a fragment of the message
    "lambda_in_a_scheduler": ("s", lambda r: torch.optim.lr_scheduler.LambdaLR(r.sgd, _Callable()), "lr_lambdas.0.fn"),
    "arbitrary_object": ("x", lambda r: _HoldsAnObject(), "nested.bad.0"),
    "complex_tensor": ("x", lambda r: _ComplexTensor(), "the tensor at z"),
    "no_state_dict": ("x", lambda r: object(), "has no state_dict()"),
    "no_load_state_dict": ("x", lambda r: _NoLoad(), "has no load_state_dict()"),
    "scheduler_of_another_optimizer": ("s", _other_optimizer, "scheduler bound to another optimizer"),
    "scheduler_of_an_unregistered_optimizer": ("s", lambda r: r.plateau, "scheduler bound to another optimizer"),
    "the_trainers_optimizer": ("o", lambda r: r.sgd, "is the trainer's optimizer"),
    "empty_name": ("", lambda r: r.tokens, "non-empty"),
    "dotted_name": ("a.b", lambda r: r.tokens, "letters, digits"),
    "taken_name": ("ema", lambda r: TokenCounter(), "is taken"),
    "twice": ("again", lambda r: r.ema, "registered already, as 'ema'"),
}


@pytest.mark.parametrize(("name", "make", "fragment"), REFUSED.values(), ids=REFUSED.keys())
def test_registration_refuses(name: str, make: Callable[[Rig], object], fragment: str) -> None:
    rig = Rig(0, register=["ema"])
    obj = make(rig)
    with pytest.raises(ConfigError) as err:
        rig.state.register(name, obj)
    assert fragment in str(err.value), err.value
    assert list(rig.state.registered()) == ["ema"]


def test_a_scheduler_of_a_registered_optimizer_is_accepted() -> None:
    rig = Rig(0, register=["adam", "plateau"])
    assert list(rig.state.registered()) == ["adam", "plateau"]


@pytest.mark.parametrize(
    "names", [["ema"], ["ema", "tokens", "scaler"], ["ema", "counter"]], ids=["fewer", "more", "renamed"]
)
def test_a_layout_of_other_registered_names_is_refused_with_nothing_loaded(names: list[str]) -> None:
    src = Rig(1, register=["ema", "tokens"])
    src.train(2)
    dst = Rig(2, register=[])
    for n in names:
        dst.state.register(
            n, {"ema": dst.ema, "tokens": dst.tokens, "scaler": dst.scaler, "counter": TokenCounter()}[n]
        )
    before, ema_before = dst.state.checksum(), dst.ema.state_dict()
    layout, flat = src.state.pack()
    with pytest.raises(ModelMismatch, match="registered objects"):
        dst.state.unpack(layout, flat)
    assert dst.state.checksum() == before and same(dst.ema.state_dict(), ema_before)


def _edit(layout: bytes, change: Callable[[dict[str, object]], None]) -> bytes:
    meta = json.loads(layout)
    change(meta)
    return json.dumps(meta).encode()


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["extras"]["ema"].__setitem__("best", {"$pickle": "x"}),
        lambda m: m["extras"]["ema"]["shadow"].__setitem__("0.weight", 5),  # the tensor entry is left over
        lambda m: m.__setitem__("extras", []),
        lambda m: m["extras"]["adam"]["param_groups"].pop(),
        lambda m: m.__setitem__("cuda_rng", [16]),  # bytes the buffer does not have
    ],
    ids=["unknown_tag", "unreferenced_tensor", "extras_not_an_object", "registered_optimizer_groups", "rng_sizes"],
)
def test_a_malformed_extras_layout_is_refused_with_nothing_loaded(change: Callable[[dict[str, object]], None]) -> None:
    src, dst = Rig(1), Rig(2)
    src.train(2)
    before = state_dicts(dst)
    checksum = dst.state.checksum()
    layout, flat = src.state.pack()
    with pytest.raises(StateCorrupt):
        dst.state.unpack(_edit(layout, change), flat)
    assert dst.state.checksum() == checksum and same(state_dicts(dst), before)


# -- the CUDA RNG ---------------------------------------------------------------------------------


class GeneratorRng:
    """``DeviceRng`` over CPU generators, standing in for CUDA devices."""

    def __init__(self, seeds: Sequence[int]) -> None:
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]

    def states(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self.gens]

    def load(self, states: Sequence[torch.Tensor]) -> None:
        for g, s in zip(self.gens, states):
            g.set_state(s)


def test_device_rng_states_travel_and_are_outside_the_checksum() -> None:
    model = make_model(0)
    src = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), GeneratorRng([1, 2]))
    for g in src.device_rng.gens:  # type: ignore[attr-defined]
        torch.rand(3, generator=g)
    other = make_model(0)
    dst = TrainingState(other, torch.optim.SGD(other.parameters(), lr=0.1), GeneratorRng([3, 4]))
    assert src.checksum() == dst.checksum()  # they differ only in their device RNG
    layout, flat = src.pack()
    assert json.loads(layout)["cuda_rng"] == [s.numel() for s in src.device_rng.states()]
    dst.unpack(layout, flat.clone())
    for a, b in zip(src.device_rng.gens, dst.device_rng.gens):  # type: ignore[attr-defined]
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_cuda_rng_reads_and_loads_torch_cuda_where_cuda_is_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    loaded: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: loaded.append((d, s)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert CudaRng().states() == []  # no context is created just to read a seed state
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert [s.tolist() for s in CudaRng().states()] == [s.tolist() for s in states]
    CudaRng().load(states)
    assert [(d, s.tolist()) for d, s in loaded] == [(0, states[0].tolist())]  # this process has one device


def test_without_cuda_nothing_is_read_or_loaded() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    assert CudaRng().states() == []
    CudaRng().load([torch.zeros(16, dtype=torch.uint8)])  # a GPU worker's state on a CPU worker: ignored


def test_a_load_refused_half_way_restores_what_was_there() -> None:
    """The optimizer and the objects loaded before a refusing one get their previous state back."""
    src, dst = Rig(1), Rig(2)
    src.train(3)
    dst.train(1)
    before = state_dicts(dst)
    layout, arena = src.state.pack()

    own = dst.tokens.state_dict()
    load = dst.tokens.load_state_dict

    def refuse(sd: dict[str, int]) -> None:  # refuses the peer's state, takes its own back
        if sd != own:
            raise ValueError("this token counter refuses")
        load(sd)

    dst.tokens.load_state_dict = refuse  # type: ignore[method-assign]  # the last registered object
    with pytest.raises(StateCorrupt, match="tokens"):
        dst.state.unpack(layout, arena.clone())
    after = state_dicts(dst)
    for name in ("sgd", "adam", "warmup_cosine", "plateau", "scaler", "ema", "model"):
        assert same(after[name], before[name]), name


@pytest.mark.parametrize(
    ("value", "live", "devices"),
    [
        (torch.ones(2), torch.empty(2, device="meta"), ["meta"]),
        ({"a": torch.ones(1), "b": 3}, {"a": torch.empty(1, device="meta")}, ["meta"]),
        ([torch.ones(1), torch.ones(1)], [torch.empty(1, device="meta"), 0], ["meta", "cpu"]),
        ((torch.ones(1),), None, ["cpu"]),  # nothing to follow: stays
        ({"new": torch.ones(1)}, {}, ["cpu"]),
    ],
)
def test_registered_tensors_load_on_the_device_of_the_objects_own(
    value: object, live: object, devices: list[str]
) -> None:
    from elasticd.worker.state.extras import like_devices

    out = like_devices(value, live)
    found: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            found.append(v.device.type)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(out)
    assert found == devices
    assert type(out) is type(value)
