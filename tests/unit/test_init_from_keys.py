"""``init_from``: the keys of a plain ``torch.save`` checkpoint mapped to the trainer's model, optimizers,
registered objects and step count (table-driven); unused keys named; ambiguity and misfits refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elasticd.errors import ConfigError
from elasticd.worker.checkpoints import InitialLoad, load_initial, unwrapped

pytestmark = pytest.mark.timeout(60)


class Rig:
    """A model, its SGD with momentum, a second optimizer, an LR scheduler and an EMA kept as a plain
    dict; ``registered`` as the trainer registers them (the second optimizer as ``optimizer_1``)."""

    def __init__(self, seed: int, scheduler_name: str = "lr", trained: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.opt = torch.optim.SGD(self.model[0].parameters(), lr=0.1, momentum=0.9)
        self.opt2 = torch.optim.Adam(self.model[1].parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2)
        self.ema = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.registered: dict[str, object] = {"optimizer_1": self.opt2, scheduler_name: self.sched, "ema": self.ema}
        if trained:
            for _ in range(3):
                self.opt.zero_grad()
                self.opt2.zero_grad()
                self.model(torch.randn(5, 4)).pow(2).mean().backward()
                self.opt.step()
                self.opt2.step()
                self.sched.step()
            for k, v in self.model.state_dict().items():
                self.ema[k].copy_(v * 0.5)

    def load(self, path: Path) -> InitialLoad:
        return load_initial(path, self.model, [self.opt, self.opt2], self.registered)


def _save(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "ck.pt"
    torch.save(data, path)
    return path


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _momentum(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"] for g in opt.param_groups for p in g["params"]]


@pytest.fixture
def src() -> Rig:
    return Rig(1, trained=True)


@pytest.mark.parametrize("key", ["model", "model_state_dict", "state_dict", "module"])
def test_each_spelling_of_the_model(tmp_path: Path, src: Rig, key: str) -> None:
    dst = Rig(2)
    got = dst.load(_save(tmp_path, {key: src.model.state_dict()}))
    assert got == InitialLoad(("model",), (), None)
    assert _same_tensors(dst.model.state_dict(), src.model.state_dict())


def test_a_bare_model_state_dict(tmp_path: Path, src: Rig) -> None:
    dst = Rig(2)
    got = dst.load(_save(tmp_path, src.model.state_dict()))
    assert got == InitialLoad(("model",), (), None)
    assert _same_tensors(dst.model.state_dict(), src.model.state_dict())


@pytest.mark.parametrize("key", ["optimizer", "opt", "optim", "optimizer_state_dict"])
def test_each_spelling_of_the_optimizer(tmp_path: Path, src: Rig, key: str) -> None:
    dst = Rig(2)
    got = dst.load(_save(tmp_path, {"model": src.model.state_dict(), key: src.opt.state_dict()}))
    assert got.loaded == ("model", "optimizer") and got.unused == ()
    assert all(torch.equal(a, b) for a, b in zip(_momentum(dst.opt), _momentum(src.opt), strict=True))


def test_several_optimizers_by_their_registered_names_or_as_a_list(tmp_path: Path, src: Rig) -> None:
    for data in (
        {"model": src.model.state_dict(), "optimizer": src.opt.state_dict(), "optimizer_1": src.opt2.state_dict()},
        {"model": src.model.state_dict(), "optimizers": [src.opt.state_dict(), src.opt2.state_dict()]},
    ):
        dst = Rig(2)
        got = dst.load(_save(tmp_path, data))
        assert got.loaded == ("model", "optimizer", "optimizer_1") and got.unused == ()
        assert dst.opt2.state_dict()["state"][0]["step"] == src.opt2.state_dict()["state"][0]["step"] == 3
        assert len(_momentum(dst.opt)) == 2


@pytest.mark.parametrize("key", ["lr", "scheduler", "sched", "lr_scheduler", "scheduler_state_dict"])
def test_the_one_registered_scheduler_by_its_name_or_each_spelling(tmp_path: Path, src: Rig, key: str) -> None:
    dst = Rig(2, scheduler_name="lr")
    got = dst.load(_save(tmp_path, {"model": src.model.state_dict(), key: src.sched.state_dict()}))
    assert got.loaded == ("model", "lr") and got.unused == ()
    assert dst.sched.last_epoch == src.sched.last_epoch == 3


def test_with_two_registered_schedulers_a_scheduler_key_is_left_unused(tmp_path: Path, src: Rig) -> None:
    dst = Rig(2)
    dst.registered["warmup"] = torch.optim.lr_scheduler.LinearLR(dst.opt2, total_iters=2)
    got = dst.load(_save(tmp_path, {"model": src.model.state_dict(), "scheduler": src.sched.state_dict()}))
    assert got.loaded == ("model",) and got.unused == ("scheduler",)
    assert dst.sched.last_epoch == 0


def test_a_registered_plain_value_is_loaded_in_place(tmp_path: Path, src: Rig) -> None:
    dst = Rig(2)
    ema, weight = dst.ema, dst.ema["0.weight"]
    got = dst.load(_save(tmp_path, {"model": src.model.state_dict(), "ema": src.ema}))
    assert got.loaded == ("model", "ema")
    assert dst.registered["ema"] is ema and ema["0.weight"] is weight
    assert _same_tensors(ema, src.ema)


def test_a_registered_name_wins_over_a_spelling(tmp_path: Path, src: Rig) -> None:
    dst = Rig(2)
    counters = {"n": 0}
    dst.registered["opt"] = counters  # the user's own "opt": not the optimizer
    got = dst.load(_save(tmp_path, {"model": src.model.state_dict(), "opt": {"n": 5}}))
    assert got.loaded == ("model", "opt") and counters == {"n": 5}
    assert not dst.opt.state


@pytest.mark.parametrize("key", ["step", "global_step", "iteration", "steps"])
def test_each_spelling_of_the_step(tmp_path: Path, src: Rig, key: str) -> None:
    got = Rig(2).load(_save(tmp_path, {"model": src.model.state_dict(), key: 40}))
    assert got == InitialLoad(("model",), (), 40)


def test_a_step_as_an_integer_tensor_and_equal_steps_under_two_keys(tmp_path: Path, src: Rig) -> None:
    got = Rig(2).load(_save(tmp_path, {"model": src.model.state_dict(), "step": torch.tensor(12), "global_step": 12}))
    assert got.step == 12 and got.unused == ()


def test_the_keys_not_used_are_returned_and_logged(tmp_path: Path, src: Rig) -> None:
    data = {
        "model": src.model.state_dict(),
        "opt": src.opt.state_dict(),
        "sched": src.sched.state_dict(),
        "ema": src.ema,
        "step": 40,
        "epoch": 3,
        "args": {"lr": 0.1},
        "best_loss": 0.25,
    }
    with capture_logs() as logs:
        got = Rig(2).load(_save(tmp_path, data))
    assert got == InitialLoad(("model", "optimizer", "lr", "ema"), ("epoch", "args", "best_loss"), 40)
    warned = [e for e in logs if e["event"] == "init_from_keys_unused"]
    assert len(warned) == 1 and warned[0]["keys"] == ["epoch", "args", "best_loss"]
    assert warned[0]["log_level"] == "warning"


def test_nothing_unused_logs_no_warning(tmp_path: Path, src: Rig) -> None:
    with capture_logs() as logs:
        Rig(2).load(_save(tmp_path, {"model": src.model.state_dict(), "step": 1}))
    assert not [e for e in logs if e["event"] == "init_from_keys_unused"]


AMBIGUOUS = {  # keys of the file besides "model" -> the fragment naming both
    "optimizer_and_opt": (
        {"optimizer": "opt", "opt": "opt"},
        "holds both 'optimizer' and 'opt', which would both load the optimizer",
    ),
    "model_and_state_dict": (
        {"state_dict": "model"},
        "holds both 'model' and 'state_dict', which would both load the model",
    ),
    "scheduler_and_sched": (
        {"scheduler": "sched", "sched": "sched"},
        "holds both 'scheduler' and 'sched', which would both load the registered 'lr' (StepLR)",
    ),
    "name_and_spelling": ({"lr": "sched", "lr_scheduler": "sched"}, "holds both 'lr' and 'lr_scheduler'"),
    "optimizer_and_list": (
        {"optimizer": "opt", "optimizers": ["opt", "opt2"]},
        "holds both 'optimizer' and 'optimizers[0]'",
    ),
    "two_steps": (
        {"step": 4, "global_step": 5},
        "holds both 'step' = 4 and 'global_step' = 5, two different step counts",
    ),
}


@pytest.mark.parametrize(("extra", "fragment"), AMBIGUOUS.values(), ids=AMBIGUOUS.keys())
def test_two_keys_for_one_object_are_refused_with_both_named(
    tmp_path: Path, src: Rig, extra: dict[str, object], fragment: str
) -> None:
    states = {
        "opt": src.opt.state_dict(),
        "opt2": src.opt2.state_dict(),
        "sched": src.sched.state_dict(),
        "model": src.model.state_dict(),
    }

    def resolve(v: object) -> object:
        return [states[x] for x in v] if isinstance(v, list) else states.get(v, v) if isinstance(v, str) else v

    dst = Rig(2)
    before = {k: v.clone() for k, v in dst.model.state_dict().items()}
    data = {"model": src.model.state_dict(), **{k: resolve(v) for k, v in extra.items()}}
    with pytest.raises(ConfigError) as err:
        dst.load(_save(tmp_path, data))
    assert fragment in str(err.value), err.value
    assert str(err.value).startswith("init_from: ")
    assert _same_tensors(dst.model.state_dict(), before)  # refused before anything was loaded


REFUSED = {  # the file -> a fragment of the message
    "no_model": ({"weights": {"w": torch.zeros(1)}, "step": 3}, "holds no model weights: none of the keys"),
    "empty": ({}, "holds no model weights"),
    "negative_step": ({"model": "model", "step": -1}, "'step' holds -1, which is no step count (an int >= 0)"),
    "float_step": ({"model": "model", "global_step": 2.5}, "'global_step' holds 2.5, which is no step count"),
    "bool_step": ({"model": "model", "iteration": True}, "'iteration' holds True, which is no step count"),
    "float_tensor_step": ({"model": "model", "steps": torch.tensor(2.0)}, "'steps' holds tensor(2.), which is no"),
    "short_optimizers_list": (
        {"model": "model", "optimizers": ["opt"]},
        "'optimizers' holds 1 entries, and the trainer has 2 optimizer(s)",
    ),
    "optimizer_misfit": ({"model": "model", "opt": "one_param"}, "'opt' does not fit the optimizer"),
    "ema_misfit": (
        {"model": "model", "ema": {"0.weight": torch.zeros(1)}},
        "'ema' does not fit the registered 'ema' (dict)",
    ),
    "a_list": ([1, 2], "holds a list, not a state_dict"),
}


@pytest.mark.parametrize(("data", "fragment"), REFUSED.values(), ids=REFUSED.keys())
def test_a_file_that_does_not_fit_is_refused(tmp_path: Path, src: Rig, data: object, fragment: str) -> None:
    states = {
        "model": src.model.state_dict(),
        "opt": src.opt.state_dict(),
        "one_param": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).state_dict(),
    }
    if isinstance(data, dict):
        data = {
            k: [states[x] for x in v] if k == "optimizers" else states.get(v, v) if isinstance(v, str) else v
            for k, v in data.items()
        }
    with pytest.raises(ConfigError) as err:
        Rig(2).load(_save(tmp_path, data))
    assert fragment in str(err.value), err.value


def test_a_file_weights_only_refuses_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be loaded with weights_only=True"):
        Rig(2).load(_save(tmp_path, {"model": torch.nn.Linear(2, 2)}))
    with pytest.raises(ConfigError, match="does not exist"):
        Rig(2).load(tmp_path / "missing.pt")


def test_a_model_saved_from_its_ddp_wrapper_loads_without_the_module_prefix(tmp_path):
    torch.manual_seed(1)
    saved = torch.nn.Linear(4, 2)
    path = tmp_path / "ddp.pt"
    torch.save({"model": {f"module.{k}": v for k, v in saved.state_dict().items()}, "step": 3}, path)
    model = torch.nn.Linear(4, 2)
    got = load_initial(path, model, [torch.optim.SGD(model.parameters(), lr=0.1)], {})
    assert got.step == 3 and "model" in got.loaded
    torch.testing.assert_close(model.weight, saved.weight)


@pytest.mark.parametrize(
    ("state", "prefixed_model", "stripped"),
    [
        ({"module.w": 1, "module.b": 2}, False, True),
        ({"module.w": 1, "b": 2}, False, False),  # not every key: not a wrapper's
        ({"module.w": 1}, True, False),  # the model itself has module.* keys
        ({}, False, False),
    ],
)
def test_unwrapped_takes_off_a_ddp_prefix_only_when_every_key_has_it(state, prefixed_model, stripped):
    model = torch.nn.Sequential()
    if prefixed_model:
        model.add_module("module", torch.nn.Linear(1, 1))
    out = unwrapped(state, model)
    assert (out != state) is stripped
