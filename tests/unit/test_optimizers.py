"""Optimizers: several optimizers, a GradScaler, and the linear-scaling factor applied to one step only."""

from __future__ import annotations

import pytest
import structlog
import torch

from elasticd.errors import ConfigError
from elasticd.worker.step.optimizers import Optimizers


def _model_and_grad() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    m.weight.grad = torch.ones_like(m.weight)
    m.bias.grad = torch.ones_like(m.bias)
    return m, m.weight.detach().clone()


@pytest.mark.parametrize(("factor", "lr", "moved"), [(1.0, 0.1, 0.1), (0.25, 0.1, 0.025), (3.0, 0.01, 0.03)])
def test_the_factor_scales_the_step_and_leaves_param_groups_alone(factor: float, lr: float, moved: float) -> None:
    m, before = _model_and_grad()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    o = Optimizers(opt)
    o.factor = factor
    o.step()
    assert torch.allclose(before - m.weight.detach(), torch.full_like(before, moved))
    assert opt.param_groups[0]["lr"] == lr  # a scheduler's rate, and the synced one, stay unscaled


def test_every_optimizer_steps() -> None:
    m, before = _model_and_grad()
    a = torch.optim.SGD([m.weight], lr=0.1)
    b = torch.optim.SGD([m.bias], lr=0.5)
    bias = m.bias.detach().clone()
    Optimizers([a, b]).step()
    assert torch.allclose(before - m.weight.detach(), torch.full_like(before, 0.1))
    assert torch.allclose(bias - m.bias.detach(), torch.full_like(bias, 0.5))


def test_the_scaler_steps_and_updates_and_forgets_an_unscale_of_a_skipped_step() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    before = m.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    o = Optimizers(opt, scaler)
    for attempt in range(2):  # the first attempt is not committed; the retry does it all again
        opt.zero_grad()
        scaler.scale(m(torch.ones(1, 3)).sum()).backward()  # d/dweight = 1, scaled by 4
        scaler.unscale_(opt)  # the user unscales before clipping
        if attempt == 0:
            o.skip()  # without it, the retry's unscale_ raises "already been called"
    o.step()
    assert torch.allclose(before - m.weight.detach(), torch.full_like(before, 0.1))
    assert scaler.get_scale() == 8.0  # update() ran once (growth_interval 1)


def test_a_change_of_factor_is_logged() -> None:
    m, _ = _model_and_grad()
    o = Optimizers(torch.optim.SGD(m.parameters(), lr=0.1))
    with structlog.testing.capture_logs() as logs:
        o.rescale(3, 2, generation=5)
        o.rescale(3, 2, generation=6)
    assert [e["event"] for e in logs] == ["lr_scaled"]
    assert logs[0]["factor"] == 1.5 and logs[0]["lrs"] == [pytest.approx(0.15)]


@pytest.mark.parametrize("bad", [[], ["sgd"], object()])
def test_not_an_optimizer_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="optimizer"):
        Optimizers(bad)  # type: ignore[arg-type]


def test_a_scaler_without_step_is_a_config_error() -> None:
    m, _ = _model_and_grad()
    with pytest.raises(ConfigError, match="scaler"):
        Optimizers(torch.optim.SGD(m.parameters(), lr=0.1), scaler=object())
