"""--wan-estimate auto's pilot: the estimate is on where a share learns faster at the data centres' count times
the rate, off where that rate is past what the model takes."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.gaia import EstimatePilot, Pilot, pilot_estimate


def _regression(samples: int = 400) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """y = X w* on standard normal X: the mean squared error's Hessian is about 2 I, so plain SGD is stable below
    a rate of about 1 (2 over the largest eigenvalue) and faster the closer it is below that."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=gen)
    y = x @ torch.randn(4, 1, generator=gen)
    torch.manual_seed(0)
    return nn.Linear(4, 1, bias=False), x, y


def _pilot(sites: int, rate: float = 0.01, samples: int = 400) -> Pilot:
    model, x, y = _regression(samples)
    return Pilot(
        model=model,
        batch=lambda index: (x[index], y[index]),
        samples=samples,
        loss_fn=F.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=rate),
        sites=sites,
        share=16,
        seed=0,
        device=torch.device("cpu"),
    )


def test_a_rate_far_below_the_stable_one_gains_from_the_estimate() -> None:
    pilot = _pilot(3)
    first = [p.detach().clone() for p in pilot.model.parameters()]
    state = torch.get_rng_state()
    chosen = pilot_estimate(pilot)
    assert chosen.estimate and chosen.sites == 3
    assert chosen.scaled_score < chosen.score and (chosen.steps, chosen.share) == (40, 16)
    assert all(torch.equal(a, b) for a, b in zip(first, pilot.model.parameters(), strict=True))  # runs train copies
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state as it was
    assert pilot.score(1.0) == chosen.score and pilot.score(3) == chosen.scaled_score  # same batches, same order


def test_for_sgd_a_scaled_gradient_is_a_scaled_rate() -> None:
    """The estimate steps on D times the share's gradient: for plain SGD, a rate D times higher."""
    assert _pilot(3, rate=0.01).score(3) == pytest.approx(_pilot(3, rate=0.03).score(1.0), rel=1e-5)


def test_adam_barely_follows_a_scaled_gradient() -> None:
    """Adam's steps do not follow a gradient's scale: the scaled run is near the plain one, not the higher rate's."""
    model, x, y = _regression()
    adam = Pilot(
        model=model,
        batch=lambda index: (x[index], y[index]),
        samples=400,
        loss_fn=F.mse_loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        sites=3,
        share=16,
        seed=0,
        device=torch.device("cpu"),
    )
    plain, scaled = adam.score(1.0), adam.score(3)
    assert scaled == pytest.approx(plain, rel=1e-3)


def test_a_scaled_rate_past_the_stable_one_keeps_the_estimate_off() -> None:
    near = pilot_estimate(_pilot(3, rate=0.4))  # 1.2: the largest batch curvatures make some steps grow
    assert not near.estimate and near.scaled_score > near.score
    diverged = pilot_estimate(_pilot(10, rate=0.4))  # 4.0: every step grows, past float32's range within 40 steps
    assert math.isinf(diverged.scaled_score) and math.isfinite(diverged.score) and not diverged.estimate


def test_the_outcome_of_two_runs_made_apart_is_the_same_choice() -> None:
    """A job runs the two rates on two workers and puts their scores together."""
    pilot = _pilot(3)
    apart = pilot.outcome(pilot.score(1.0), pilot.score(3), seconds=1.5)
    together = pilot_estimate(pilot)
    assert apart == EstimatePilot(**{**vars(together), "seconds": 1.5})


def test_the_pilot_needs_samples_to_hold_out_and_a_share_to_train_on() -> None:
    with pytest.raises(ValueError, match="the pilot needs a held-out sample and a share of 16 to train on, got 10"):
        _pilot(3, samples=10)


def test_the_pilot_says_what_it_chose_in_one_line() -> None:
    line = pilot_estimate(_pilot(3)).describe()
    assert line.startswith("--wan-estimate auto: on (a share of 16 samples, 40 steps: held-out loss ")
    assert "stepping on 3 times its gradient against" in line and "\n" not in line
