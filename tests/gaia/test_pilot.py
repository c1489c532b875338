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


def _pilot(sites: int, samples: int = 400) -> Pilot:
    model, x, y = _regression(samples)
    return Pilot(
        model=model,
        batch=lambda index: (x[index], y[index]),
        samples=samples,
        loss_fn=F.mse_loss,
        optimizer=lambda params, rate: torch.optim.SGD(params, lr=rate),
        sites=sites,
        share=16,
        seed=0,
        device=torch.device("cpu"),
    )


def test_a_rate_far_below_the_stable_one_gains_from_the_estimate() -> None:
    pilot = _pilot(3)
    first = [p.detach().clone() for p in pilot.model.parameters()]
    chosen = pilot_estimate(pilot, 0.01)
    assert chosen.estimate and chosen.scaled_rate == pytest.approx(0.03)
    assert chosen.scaled_score < chosen.score and (chosen.steps, chosen.share) == (40, 16)
    assert all(torch.equal(a, b) for a, b in zip(first, pilot.model.parameters(), strict=True))  # runs train copies
    assert pilot.score(0.01) == chosen.score and pilot.score(0.03) == chosen.scaled_score  # same batches, same order


def test_a_scaled_rate_past_the_stable_one_keeps_the_estimate_off() -> None:
    near = pilot_estimate(_pilot(3), 0.4)  # 1.2: the largest batch curvatures make some steps grow
    assert not near.estimate and near.scaled_score > near.score
    diverged = pilot_estimate(_pilot(10), 0.4)  # 4.0: every step grows, past float32's range within 40 steps
    assert math.isinf(diverged.scaled_score) and math.isfinite(diverged.score) and not diverged.estimate


def test_the_outcome_of_two_runs_made_apart_is_the_same_choice() -> None:
    """A job runs the two rates on two workers and puts their scores together."""
    pilot = _pilot(3)
    apart = pilot.outcome(0.01, pilot.score(0.01), pilot.score(0.03), seconds=1.5)
    together = pilot_estimate(pilot, 0.01)
    assert apart == EstimatePilot(**{**vars(together), "seconds": 1.5})


def test_the_pilot_needs_samples_to_hold_out_and_a_share_to_train_on() -> None:
    with pytest.raises(ValueError, match="the pilot needs a held-out sample and a share of 16 to train on, got 10"):
        _pilot(3, samples=10)


def test_the_pilot_says_what_it_chose_in_one_line() -> None:
    line = pilot_estimate(_pilot(3), 0.01).describe()
    assert line.startswith("--wan-estimate auto: on (a share of 16 samples, 40 steps: held-out loss ")
    assert "at 0.03 against" in line and "\n" not in line
