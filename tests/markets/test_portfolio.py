"""Tributary's portfolio: survival of the needed capacity under correlated losses, and the holding chosen."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.markets import Losses, choose
from conveyor.markets._portfolio import _losses, survival  # the module's own helpers, tested alone


@given(p=st.tuples(st.floats(0.01, 0.6), st.floats(0.01, 0.6)))
def test_independent_losses_survive_as_the_product_says(p: tuple[float, float]) -> None:
    losses = Losses(np.array(p), np.ones(2), np.eye(2))
    alive, _, _ = survival(np.array([1, 1]), np.ones(2), _losses(losses), np.ones(2), 1.0)
    assert alive == pytest.approx(1 - p[0] * p[1], abs=0.03)  # 2000 draws: about 3 standard errors


def test_perfectly_correlated_markets_give_no_diversity() -> None:
    together = Losses(np.array([0.2, 0.2]), np.ones(2), np.ones((2, 2)) - 1e-9 * np.eye(2))
    alive, _, _ = survival(np.array([1, 1]), np.ones(2), _losses(together), np.ones(2), 1.0)
    assert alive == pytest.approx(0.8, abs=0.03)


def test_a_loss_takes_its_share_of_a_markets_machines() -> None:
    """Four machines in one market that loses half of them in every draw: two survive."""
    lost = np.ones((10, 1), dtype=bool)
    assert survival(np.array([4]), np.ones(1), lost, np.array([0.5]), 2.0) == (1.0, 1.0, 1.0)
    assert survival(np.array([4]), np.ones(1), lost, np.array([0.5]), 3.0)[0] == 0.0


def test_the_portfolio_meets_its_target_with_the_cheapest_safe_markets() -> None:
    losses = Losses(np.array([0.3, 0.3, 0.3, 0.01]), np.ones(4), np.eye(4))
    prices = np.array([1.0, 1.0, 1.0, 5.0])
    held = choose(
        available=np.array([1, 1, 1, 1]),
        speeds=np.ones(4),
        prices=prices,
        losses=losses,
        required=1.0,
        target=0.95,
        extra=3,
    )
    # three cheap risky machines (1 - 0.3^3 = 0.973) cost 3; the safe one alone costs 5
    assert held.machines == (1, 1, 1, 0) and held.survival >= 0.95 and held.price_per_h == 3.0


def test_the_portfolio_holds_no_more_than_needed_plus_extra_and_only_what_is_available() -> None:
    losses = Losses(np.full(3, 0.5), np.ones(3), np.eye(3))
    held = choose(
        available=np.array([0, 2, 5]),
        speeds=np.ones(3),
        prices=np.ones(3),
        losses=losses,
        required=2.0,
        target=0.999,
        extra=1,
    )
    assert sum(held.machines) == 3 and held.machines[0] == 0 and held.machines[1] <= 2


def test_without_a_binding_target_the_portfolio_holds_the_expected_capacity_only() -> None:
    """One machine of a market that loses it with p = 0.05 covers R = 0.9 in expectation (0.95): with the target
    binding a second is bought for survival, without it not."""
    losses = Losses(np.array([0.05, 0.05]), np.ones(2), np.eye(2))
    kw = {"available": np.array([1, 1]), "speeds": np.ones(2), "prices": np.ones(2), "losses": losses}
    assert sum(choose(**kw, required=0.9, target=0.99, extra=2).machines) == 2
    assert sum(choose(**kw, required=0.9, target=0.99, extra=2, binding=False).machines) == 1


def test_machines_held_are_kept_while_needed_and_surplus_given_back() -> None:
    """Two equal markets: the one held already is kept (a move pays a start again); of three held where one is
    needed, two go back, the riskiest first."""
    losses = Losses(np.array([0.08, 0.06, 0.01]), np.ones(3), np.eye(3))
    kw = {"available": np.array([1, 1, 1]), "speeds": np.ones(3), "prices": np.ones(3), "losses": losses}
    fresh = choose(**kw, required=0.9, target=0.99, extra=2, binding=False)
    assert fresh.machines == (0, 0, 1)  # the safest market, from nothing
    kept = choose(**kw, required=0.9, target=0.99, extra=2, binding=False, held_now=np.array([1, 0, 0]))
    assert kept.machines == (1, 0, 0)
    trimmed = choose(**kw, required=0.9, target=0.99, extra=2, binding=False, held_now=np.array([1, 1, 1]))
    assert trimmed.machines == (0, 0, 1)
