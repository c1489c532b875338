"""Shares weighted by measured speed: a batch's samples dealt in proportion, every chunk two samples at least where
the batch allows, the whole batch always, and a share whose fixed point is equal finishing times."""

from hypothesis import given
from hypothesis import strategies as st

from conveyor.stragglers._shares import ShareWeights, deal, equal_cut


@given(
    speeds=st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=8),
    samples=st.integers(0, 4096),
    least=st.integers(1, 8),
)
def test_every_sample_is_dealt_and_everyone_keeps_the_least_the_batch_allows(
    speeds: list[float], samples: int, least: int
) -> None:
    shares = deal(speeds, samples, least)
    assert sum(shares) == samples and len(shares) == len(speeds)
    if samples >= least * len(speeds):
        assert min(shares) >= least
        faster = [(a, b) for a in range(len(speeds)) for b in range(len(speeds)) if speeds[a] > 1.5 * speeds[b]]
        assert all(shares[a] >= shares[b] for a, b in faster)  # a replica much faster never holds less
    else:
        assert shares == equal_cut(samples, len(speeds))


def test_cuts_stay_equal_until_every_replica_is_measured_then_follow_the_last_speeds() -> None:
    weights = ShareWeights(3, 2)
    weights.update([10.0, 10.0, 0.0])  # replica 2 ran nothing: not measured yet
    assert weights.shares() == [2, 2, 2] and weights.cut(24) == equal_cut(24, 6) == [4] * 6
    weights.update([10.0, 11.0, 5.0])  # replica 1 within 20% of the median: the median's
    assert weights.shares() == [3, 2, 1] and weights.cut(25) == [4, 3, 3, 5, 5, 5]  # 10, 10, 5 samples
    weights.update([10.0, 0.0, 20.0])  # replica 1 ran nothing: its last speed kept
    assert weights.speeds == [10.0, 11.0, 20.0] and weights.shares() == [2, 1, 3]


def test_dealing_by_measured_speed_reaches_equal_finishing_times() -> None:
    # A chunk costs a fixed 16 ms and 0.96 ms a sample on a replica at full speed (the benchmark's resnet at 0.45
    # cores); replica 3 runs at a third. Speeds measured in samples a second include the fixed part.
    weights, relative = ShareWeights(4, 2), [1.0, 1.0, 1.0, 1 / 3]

    def step() -> tuple[list[int], list[float]]:
        """Each replica's samples and seconds in a step of 256 samples cut by the weights."""
        counts, cut = weights.shares(), weights.cut(256)
        first = [sum(counts[:w]) for w in range(4)]
        shares = [sum(cut[first[w] : first[w] + counts[w]]) for w in range(4)]
        return shares, [(16 * c + 0.96 * n) / s / 1000 for c, n, s in zip(counts, shares, relative, strict=True)]

    for _ in range(6):
        shares, times = step()
        weights.update([n / t for n, t in zip(shares, times, strict=True)])
    shares, times = step()
    assert max(times) / min(times) < 1.3  # whole chunks: the slow replica keeps one, the fast ones two or three
    assert max(times) < 0.13 < (2 * 16 + 0.96 * 64) * 3 / 1000  # against 280 ms with equal shares
