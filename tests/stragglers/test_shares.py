"""Shares weighted by measured speed: dealt in proportion, one chunk each at least, the whole step always."""

from hypothesis import given
from hypothesis import strategies as st

from conveyor.stragglers._shares import ShareWeights, weighted_shares


@given(
    speeds=st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=8),
    chunks=st.integers(1, 6),
)
def test_every_chunk_is_dealt_and_everyone_keeps_one(speeds: list[float], chunks: int) -> None:
    shares = weighted_shares(speeds, len(speeds) * chunks)
    assert sum(shares) == len(speeds) * chunks and min(shares) >= 1
    faster = [(a, b) for a in range(len(speeds)) for b in range(len(speeds)) if speeds[a] > 1.5 * speeds[b]]
    assert all(shares[a] >= shares[b] for a, b in faster)  # a replica much faster never owns less


def test_shares_stay_equal_until_every_replica_is_measured_then_follow_the_smoothed_speeds() -> None:
    weights = ShareWeights(3, 2)
    assert weights.update([10.0, 10.0, 0.0]) == [2, 2, 2]  # replica 2 ran nothing: not measured yet
    assert weights.update([10.0, 10.0, 2.0]) == [3, 2, 1]
    assert weights.speeds == [10.0, 10.0, 2.0]
    assert weights.update([10.0, 0.0, 18.0]) == [2, 2, 2]  # replica 2 at (2 + 18) / 2; replica 1's kept
    assert weights.speeds == [10.0, 10.0, 10.0]
