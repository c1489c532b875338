"""The preemption model: it reads nothing past the decision, and its probabilities match what happens."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from conveyor.markets import MarketTrace, calibration, features, fit, labels


def _market(seed: int, ticks: int = 3000, p_drop: float = 0.02, name: str = "z1a") -> MarketTrace:
    """Availability that drops with probability ``p_drop`` a tick and comes back with 0.2."""
    rng = np.random.default_rng(seed)
    c, up = [], 1
    for _ in range(ticks):
        up = int(rng.random() >= p_drop) if up else int(rng.random() < 0.2)
        c.append(up)
    return MarketTrace(name, "v100_1", 600.0, np.array(c, dtype=np.int64))


def test_labels_say_whether_a_held_machine_is_lost_within_the_horizon() -> None:
    m = MarketTrace("z1a", "v100_1", 60.0, np.array([2, 2, 1, 0, 1, 1, 1, 1]))
    y = labels(m, 2)
    # tick 3 is empty and the last two ticks' horizons run past the trace: unknown
    assert np.array_equal(y, [1.0, 1.0, 1.0, np.nan, 0.0, 0.0, np.nan, np.nan], equal_nan=True)


@given(t=st.integers(min_value=50, max_value=2900), seed=st.integers(0, 3))
def test_nothing_after_the_decision_changes_the_model_or_the_features(t: int, seed: int) -> None:
    """The future of the trace is replaced by its opposite: the fit and the forecast at ``t`` do not move."""
    m = _market(seed)
    flipped = MarketTrace(m.zone, m.instance, m.gap_s, np.concatenate([m.counts[: t + 1], 1 - m.counts[t + 1 :]]))
    a, b = fit([m], until=t, horizon=6), fit([flipped], until=t, horizon=6)
    assert np.allclose(a.weights, b.weights) and a.bias == b.bias
    assert np.allclose(features(m)[: t + 1], features(flipped)[: t + 1])
    assert np.allclose(a.predict(features(m)[t : t + 1]), b.predict(features(flipped)[t : t + 1]))


def test_predicted_loss_rates_match_the_observed_ones_on_held_back_data() -> None:
    """A market with a constant hazard: 1 - (1 - 0.02)^6 = 0.114 of held machines lost within 6 ticks."""
    markets = [_market(s, ticks=6000, name=f"z1{chr(97 + s)}") for s in range(3)]
    rows = calibration(markets, horizon=6)
    per_market = [r for r in rows if not str(r["market"]).startswith("decile")]
    assert len(per_market) == 3 and len(rows) == 13
    for r in per_market:
        assert abs(float(r["predicted_rate"]) - float(r["observed_rate"])) < 0.03
        assert abs(float(r["observed_rate"]) - 0.114) < 0.03
        assert float(r["brier"]) < 0.15  # about p (1 - p) = 0.10; a constant 0.5 would score 0.25
