"""The batch-size search: pruning order, hand-computed posteriors, Thompson sampling, early stopping."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.energy import BatchSizeSearch, Recurrence, zeus_cost

SIZES = (8, 16, 32, 64, 128)


def _run(search: BatchSizeSearch, outcome: dict[int, tuple[float, bool]], n: int) -> list[int]:
    """Sizes chosen over ``n`` recurrences when size b always costs outcome[b][0] and reaches outcome[b][1]."""
    history: list[Recurrence] = []
    for _ in range(n):
        size = search.choose(history, np.random.default_rng(0)).batch_size
        history.append(Recurrence(size, *outcome[size]))
    return [r.batch_size for r in history]


def test_zeus_cost_weighs_energy_against_time_at_full_power() -> None:
    assert zeus_cost(1000.0, 10.0, eta=1.0, max_power_w=300.0) == 1000.0  # energy alone
    assert zeus_cost(1000.0, 10.0, eta=0.0, max_power_w=300.0) == 3000.0  # time at 300 W
    with pytest.raises(ValueError, match=r"eta .* must be in \[0, 1\]"):
        zeus_cost(1.0, 1.0, eta=1.5, max_power_w=1.0)


def test_pruning_goes_down_from_the_default_then_up_and_a_failure_ends_a_direction() -> None:
    # 8 fails, so the first round tries 32, 16, 8 (fails: down ends), then 64, 128 (fails: up ends).
    # Survivors 16, 32, 64; the cheapest (16, cost 5) is the second round's default: 16 down (8 not a survivor
    # any more), then 32, 64 up. Then Thompson sampling over 16, 32, 64; 16 is always cheapest.
    outcome = {8: (1.0, False), 16: (5.0, True), 32: (6.0, True), 64: (9.0, True), 128: (1.0, False)}
    chosen = _run(BatchSizeSearch(SIZES, default=32), outcome, 12)
    assert chosen[:8] == [32, 16, 8, 64, 128, 16, 32, 64]
    assert chosen[8:] == [16, 16, 16, 16]  # every survivor has two equal rewards: precision inf, the means rule


def test_survivors_and_the_default_must_reach() -> None:
    search = BatchSizeSearch(SIZES, default=32)
    assert search.survivors([]) == 32
    with pytest.raises(ValueError, match="no batch size reached the target, not even the default 32"):
        search.survivors([Recurrence(32, 1.0, False), Recurrence(64, 1.0, False)])
    with pytest.raises(ValueError, match="default batch size 48 is not among"):
        BatchSizeSearch(SIZES, default=48)


def test_posterior_by_hand() -> None:
    # Rewards of 32: -10, -14 -> mean -12, population variance 4 -> tau = 1/4, precision n * tau = 2 / 4 = 0.5.
    search = BatchSizeSearch(SIZES, default=32)
    history = [Recurrence(32, 10.0, True), Recurrence(16, 3.0, True), Recurrence(32, 14.0, True)]
    assert search.posterior(history, 32) == (-12.0, 0.5)
    assert search.posterior(history, 16) == (-3.0, 0.0)  # one reward: no precision yet
    assert search.posterior(history, 64) == (0.0, 0.0)
    windowed = BatchSizeSearch(SIZES, default=32, window=2)  # the latest two: -14, -20 -> mean -17, variance 9
    assert windowed.posterior([*history, Recurrence(32, 20.0, True)], 32) == (-17.0, 2 / 9)


def test_thompson_sampling_draws_from_the_posterior() -> None:
    # After pruning (all reach, costs equal per size), 32 and 64 have rewards with spread; the sample for
    # each is Normal(mean, 1 / precision): the share of picks of 64 matches P(sample64 > sample32).
    search = BatchSizeSearch((32, 64), default=32)
    history = [
        Recurrence(32, 10.0, True),
        Recurrence(64, 11.0, True),
        Recurrence(32, 12.0, True),
        Recurrence(64, 13.0, True),
    ]
    assert search.survivors(history) == (32, 64)
    (m32, p32), (m64, p64) = search.posterior(history, 32), search.posterior(history, 64)
    assert (m32, p32, m64, p64) == (-11.0, 2.0, -12.0, 2.0)  # variance 1 each, two rewards
    rng = np.random.default_rng(0)
    picks = [search.choose(history, rng).batch_size for _ in range(4000)]
    # P(N(-12, 1/2) > N(-11, 1/2)) = P(N(0, 1) > 1 / sqrt(1/2 + 1/2)) = 1 - Phi(1) = 0.1587
    assert picks.count(64) / len(picks) == pytest.approx(0.1587, abs=0.02)


def test_concurrent_runs_and_failures_in_the_history() -> None:
    search = BatchSizeSearch(SIZES, default=32)
    # A run of the best size while 32 explored (explored=False) does not stand for the exploration's 16.
    history = [Recurrence(32, 10.0, True), Recurrence(16, 99.0, False, explored=False)]
    assert search.survivors(history) == 16
    # A failed run (an error: cost nan) of 16 ends the down direction, and no posterior counts its cost.
    history = [Recurrence(32, 10.0, True), Recurrence(16, math.nan, False), Recurrence(64, 8.0, True)]
    assert search.survivors(history) == 128  # down ended at 16, up goes on from 64
    assert search.posterior([*history, Recurrence(16, 5.0, True)], 16) == (-5.0, 0.0)
    with pytest.raises(ValueError, match=r"window 0 .* or at least 2"):
        BatchSizeSearch(SIZES, default=32, window=1)


def test_early_stopping_threshold_and_best() -> None:
    search = BatchSizeSearch(SIZES, default=32, beta=2.0)
    assert search.stop_above([]) == math.inf and search.best([]) == 32
    history = [Recurrence(32, 10.0, True), Recurrence(16, 7.0, True), Recurrence(8, 1.0, False)]
    assert search.stop_above(history) == 14.0  # 2 x the least cost that reached (the failure's 1.0 does not count)
    assert search.best(history) == 16


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(SIZES), st.floats(1.0, 100.0), st.booleans()), max_size=30),
    st.sampled_from(SIZES),
)
def test_any_history_gives_a_candidate_or_a_one_line_error(raw: list[tuple[int, float, bool]], default: int) -> None:
    search = BatchSizeSearch(SIZES, default=default)
    history = [Recurrence(*r) for r in raw]
    try:
        choice = search.choose(history, np.random.default_rng(0))
    except ValueError as e:
        assert "no batch size reached the target" in str(e)
        return
    assert choice.batch_size in SIZES and choice.phase in ("explore", "thompson")
