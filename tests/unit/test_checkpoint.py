"""TrainingState in one process: pack/unpack round trip, checksum, model mismatch, corrupt layouts."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from elasticd.errors import ModelMismatch, StateCorrupt
from elasticd.worker.state.training import _ALIGN, Counters, TrainingState, model_signature

pytestmark = pytest.mark.timeout(60)

Optim = Callable[[torch.nn.Module], torch.optim.Optimizer]

SGD_MOMENTUM: Optim = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
ADAM: Optim = lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.99))  # noqa: E731
ADAM_AMSGRAD: Optim = lambda m: torch.optim.Adam(m.parameters(), lr=0.02, amsgrad=True)  # noqa: E731
OPTIMIZERS = {"sgd_momentum": SGD_MOMENTUM, "adam": ADAM, "adam_amsgrad": ADAM_AMSGRAD}


def make_model(seed: int, hidden: int = 8, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    # BatchNorm adds buffers, one of them int64 (num_batches_tracked).
    return torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)
    ).to(dtype)


def make_state(seed: int = 0, optim: Optim = SGD_MOMENTUM, hidden: int = 8) -> TrainingState:
    return state_of(make_model(seed, hidden), optim)


def state_of(model: torch.nn.Module, optim: Optim = SGD_MOMENTUM) -> TrainingState:
    return TrainingState(model, optim(model))


def train(state: TrainingState, steps: int, seed: int = 100) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=gen)
        y = torch.randint(0, 3, (6,), generator=gen)
        state.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(state.model(x), y).backward()
        state.optimizer.step()
        state.counters.step += 1
        state.counters.position += 6


def assert_same_tensors(a: TrainingState, b: TrainingState) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert [n for n, _ in ta] == [n for n, _ in tb]
    for (name, x), (_, y) in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name


def copy_via_pack(src: TrainingState, dst: TrainingState) -> None:
    layout, flat = src.pack()
    dst.unpack(bytes(layout), flat.clone())


# -- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_round_trip_into_a_fresh_optimizer(optim: Optim) -> None:
    src = make_state(seed=1, optim=optim)
    train(src, 3)
    src.counters = Counters(step=17, epoch=2, position=48)
    dst = make_state(seed=2, optim=optim)  # different weights, optimizer with no state at all
    assert dst.optimizer.state_dict()["state"] == {}
    assert dst.checksum() != src.checksum()

    copy_via_pack(src, dst)

    assert_same_tensors(src, dst)
    assert dst.counters == Counters(17, 2, 48)
    assert dst.checksum() == src.checksum()
    s_sd, d_sd = src.optimizer.state_dict(), dst.optimizer.state_dict()
    assert sorted(s_sd["state"]) == sorted(d_sd["state"]) != []
    for idx, st in s_sd["state"].items():
        assert sorted(st) == sorted(d_sd["state"][idx])
        for key, value in st.items():
            other = d_sd["state"][idx][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    for gs, gd in zip(s_sd["param_groups"], d_sd["param_groups"], strict=True):
        assert gd["lr"] == gs["lr"]
        if "betas" in gs:
            assert tuple(gd["betas"]) == tuple(gs["betas"])

    # The copy is a working optimizer: the same next steps give bit-identical models.
    train(src, 2, seed=7)
    train(dst, 2, seed=7)
    assert_same_tensors(src, dst)


def test_round_trip_over_a_stepped_optimizer_replaces_its_state() -> None:
    src, dst = make_state(1, ADAM), make_state(2, ADAM)
    train(src, 4)
    train(dst, 1, seed=55)
    copy_via_pack(src, dst)
    assert_same_tensors(src, dst)
    step_src = src.optimizer.state_dict()["state"][0]["step"]
    step_dst = dst.optimizer.state_dict()["state"][0]["step"]
    assert float(step_dst) == float(step_src) == 4.0


def test_round_trip_restores_rng() -> None:
    src, dst = make_state(1), make_state(2)
    torch.manual_seed(31337)
    torch.rand(5)  # advance the generator somewhere arbitrary
    layout, flat = src.pack()
    expected = torch.rand(8)  # what the generator gives right after pack
    torch.manual_seed(0)
    dst.unpack(layout, flat)
    assert torch.equal(torch.rand(8), expected)


def test_pack_is_deterministic_and_compact() -> None:
    s = make_state(3, ADAM)
    train(s, 2)
    l1, f1 = s.pack()
    l2, f2 = s.pack()
    assert l1 == l2 and f1.dtype == f2.dtype == torch.uint8
    layout = json.loads(l1)
    for _name, _dtype, _shape, offset, nbytes in layout["tensors"]:  # alignment padding is not data
        assert torch.equal(f1[offset : offset + nbytes], f2[offset : offset + nbytes])
    assert torch.equal(f1[layout["total"] :], f2[layout["total"] :])
    payload = sum(t.numel() * t.element_size() for _, t in s.tensors())
    assert payload <= layout["total"] < payload + _ALIGN * len(layout["tensors"])  # only alignment padding
    assert all(offset % _ALIGN == 0 for *_, offset, _n in layout["tensors"])
    assert f1.numel() == layout["total"] + torch.get_rng_state().numel()


def test_round_trip_with_empty_optimizer_state() -> None:
    src, dst = make_state(1), make_state(2)
    copy_via_pack(src, dst)
    assert_same_tensors(src, dst)
    assert dst.optimizer.state_dict()["state"] == {}


# -- checksum -----------------------------------------------------------------------------------


def test_checksum_equal_for_equal_state() -> None:
    a, b = make_state(5, ADAM), make_state(5, ADAM)
    assert a.checksum() == b.checksum()
    train(a, 2)
    train(b, 2)
    assert a.checksum() == b.checksum()
    assert 0 <= a.checksum() < 2**63  # fits a signed int64 tensor for the all_reduce


def _bump_param(s: TrainingState) -> None:
    with torch.no_grad():
        next(iter(s.model.parameters())).view(-1)[0] += 1e-6


def _bump_buffer(s: TrainingState) -> None:
    s.model[1].running_mean[0] += 1e-3  # type: ignore[index]


def _bump_counter(field: str) -> Callable[[TrainingState], None]:
    def bump(s: TrainingState) -> None:
        setattr(s.counters, field, getattr(s.counters, field) + 1)

    return bump


def _bump_momentum(s: TrainingState) -> None:
    buf = s.optimizer.state[next(iter(s.model.parameters()))]["momentum_buffer"]
    buf.view(-1)[0] += 1e-6


def _extra_step(s: TrainingState) -> None:
    train(s, 1, seed=9)
    s.counters.step -= 1
    s.counters.position -= 6


@pytest.mark.parametrize(
    "change",
    [
        _bump_param,
        _bump_buffer,
        _bump_counter("step"),
        _bump_counter("epoch"),
        _bump_counter("position"),
        _bump_momentum,
        _extra_step,
    ],
    ids=["param", "buffer", "step", "epoch", "position", "momentum", "optimizer_step"],
)
def test_checksum_differs_when_state_differs(change: Callable[[TrainingState], None]) -> None:
    a, b = make_state(5), make_state(5)
    train(a, 2)
    train(b, 2)
    assert a.checksum() == b.checksum()
    change(b)
    assert a.checksum() != b.checksum()


def test_checksum_differs_between_fresh_and_stepped_optimizer() -> None:
    a, b = make_state(5), make_state(5)
    train(a, 1)
    train(b, 1)
    b.optimizer.state.clear()  # same weights, no momentum
    assert a.checksum() != b.checksum()


# -- mismatch and corruption --------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: state_of(make_model(0, hidden=9)),
        lambda: state_of(torch.nn.Sequential(make_model(0), torch.nn.Linear(3, 3))),
        lambda: state_of(torch.nn.Sequential(torch.nn.Linear(4, 8))),
        lambda: state_of(make_model(0, dtype=torch.float64)),
    ],
    ids=["different_shape", "extra_tensors", "missing_tensors", "different_dtype"],
)
def test_a_different_model_raises_model_mismatch(build: Callable[[], TrainingState]) -> None:
    src = make_state(1)
    train(src, 1)
    dst = build()
    before = [t.clone() for _, t in dst.tensors()]
    with pytest.raises(ModelMismatch):
        copy_via_pack(src, dst)
    assert all(torch.equal(x, t) for x, (_, t) in zip(before, dst.tensors(), strict=True)), "state changed"


def test_model_signature() -> None:
    assert model_signature(make_model(0)) == model_signature(make_model(1))  # values do not matter
    assert model_signature(make_model(0)) != model_signature(make_model(0, hidden=9))
    assert model_signature(make_model(0)) != model_signature(make_model(0, dtype=torch.float64))
    renamed = torch.nn.Sequential()
    for i, layer in enumerate(make_model(0)):
        renamed.add_module(f"layer{i}", layer)
    assert model_signature(renamed) != model_signature(make_model(0))
    assert make_state(0).signature == model_signature(make_model(0))


def _layout_edit(edit: Callable[[dict[str, object]], object]) -> Callable[[bytes], bytes]:
    def apply(raw: bytes) -> bytes:
        layout = json.loads(raw)
        edit(layout)
        return json.dumps(layout).encode()

    return apply


CORRUPT = [
    pytest.param(lambda raw: b"\x00garbage", id="not_json"),
    pytest.param(lambda raw: b"[]", id="json_list"),
    pytest.param(lambda raw: raw[: len(raw) // 2], id="truncated_json"),
    pytest.param(_layout_edit(lambda L: L.pop("tensors")), id="no_tensors"),
    pytest.param(_layout_edit(lambda L: L.pop("total")), id="no_total"),
    pytest.param(_layout_edit(lambda L: L.__setitem__("total", "many")), id="total_not_a_number"),
    pytest.param(_layout_edit(lambda L: L["tensors"][0].__setitem__(1, "torch.complex128")), id="unknown_dtype"),
    pytest.param(_layout_edit(lambda L: L["tensors"][0].__setitem__(1, "os.system")), id="hostile_dtype"),
    pytest.param(_layout_edit(lambda L: L["tensors"].__setitem__(0, L["tensors"][0][:3])), id="entry_too_short"),
    pytest.param(_layout_edit(lambda L: L.__setitem__("tensors", 5)), id="tensors_not_a_list"),
    pytest.param(_layout_edit(lambda L: L["tensors"][0].__setitem__(3, 10**9)), id="offset_past_buffer"),
    pytest.param(_layout_edit(lambda L: L["tensors"][0].__setitem__(4, 4)), id="nbytes_wrong_for_shape"),
    pytest.param(_layout_edit(lambda L: L.pop("param_groups")), id="no_param_groups"),
    pytest.param(_layout_edit(lambda L: L.__setitem__("param_groups", [])), id="param_group_count"),
]


@pytest.mark.parametrize("corrupt", CORRUPT)
def test_a_malformed_layout_raises_state_corrupt(corrupt: Callable[[bytes], bytes]) -> None:
    src = make_state(1)
    train(src, 1)
    layout, flat = src.pack()
    dst = make_state(2)
    with pytest.raises(StateCorrupt):
        dst.unpack(corrupt(layout), flat)


def test_a_failed_unpack_leaves_the_state_unchanged() -> None:
    src = make_state(1)
    train(src, 1)
    layout, flat = src.pack()
    bad = _layout_edit(lambda L: L.__setitem__("param_groups", []))(layout)
    dst = make_state(2)
    before = dst.checksum()
    with pytest.raises(Exception):  # noqa: B017 - the type is what the test above pins down
        dst.unpack(bad, flat)
    assert dst.checksum() == before


def test_a_truncated_buffer_is_not_loaded_silently() -> None:
    src = make_state(1)
    train(src, 1)
    layout, flat = src.pack()
    dst = make_state(2)
    with pytest.raises((StateCorrupt, RuntimeError)):
        dst.unpack(layout, flat[: flat.numel() // 2])


def test_unpack_from_an_unaligned_slice() -> None:
    """The receiver's buffer may start at any byte (sync_state puts it after the JSON layout)."""
    src, dst = make_state(1, ADAM), make_state(2, ADAM)
    train(src, 1)
    layout, flat = src.pack()
    payload = torch.zeros(3 + flat.numel(), dtype=torch.uint8)
    payload[3:].copy_(flat)
    dst.unpack(layout, payload[3:])
    assert_same_tensors(src, dst)


@pytest.mark.parametrize(
    ("world", "needy", "nbytes", "can", "expected"),
    [
        (3, [2], 34 << 20, True, [0, 1, 2]),  # sparing one rank 34 MB: not worth a group build
        (3, [2], 100 << 20, True, [0, 2]),  # sparing one rank 100 MB: a subgroup
        (8, [5], 16 << 20, True, [0, 5]),  # sparing six ranks 16 MB each
        (8, [5], 16 << 20, False, list(range(8))),  # no subgroup builder: the whole group
        (3, [1, 2], 1 << 30, True, [0, 1, 2]),  # everyone needs it
    ],
)
def test_transfer_members(world: int, needy: list[int], nbytes: int, can: bool, expected: list[int]) -> None:
    from elasticd.worker.state.sync import transfer_members

    assert transfer_members(world, needy, nbytes, can) == expected


@pytest.mark.parametrize(
    ("world", "needy", "backend", "mode", "members"),
    [
        (2, [1], "gloo", "p2p", [0, 1]),  # one newcomer: one send
        (3, [2], "gloo", "p2p", [0, 2]),  # a survivor holds it: only the newcomer takes part
        (3, [1, 2], "gloo", "p2p", [0, 1, 2]),  # two sends = the tree's two hops
        (4, [1, 2, 3], "gloo", "broadcast", [0, 1, 2, 3]),  # three sends > log2(4) hops: the tree
        (8, [3, 5, 7], "gloo", "p2p", [0, 3, 5, 7]),  # three sends = log2(8) hops
        (8, [1, 2, 3, 4], "gloo", "broadcast", [0, 1, 2, 3, 4]),  # a subgroup spares 3 ranks 34 MB each
        (3, [2], "nccl", "broadcast", [0, 1, 2]),  # NCCL keeps its pipelined broadcast
    ],
)
def test_plan_transfer(world: int, needy: list[int], backend: str, mode: str, members: list[int]) -> None:
    from elasticd.worker.state.sync import plan_transfer

    plan = plan_transfer(world, needy, 34 << 20, backend, True)
    assert (plan.mode, plan.members) == (mode, members)
