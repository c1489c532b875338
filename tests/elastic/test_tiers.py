"""AgileML's stages and roles follow the transient:reliable ratio; shards cover the parameters once."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.elastic import agile_stage, roles, shard_bounds


def test_stage_follows_the_ratio_at_the_thresholds() -> None:
    assert [agile_stage(t, 1, sync_max=2, backup_only_min=8) for t in (0, 2, 3, 7, 8, 20)] == [1, 1, 2, 2, 3, 3]
    assert agile_stage(4, 2, sync_max=2, backup_only_min=8) == 1  # the ratio, not the count
    with pytest.raises(ValueError, match="reliable"):
        agile_stage(3, 0)
    with pytest.raises(ValueError, match="thresholds"):
        agile_stage(3, 1, sync_max=5, backup_only_min=2)


def test_roles_of_each_stage() -> None:
    assert roles([0, 1, 2], reliable=[0]) == roles([0, 1, 2], [0], stage=1)
    one = roles([0, 1, 2], [0], stage=1)
    assert one.compute == (0, 1, 2) and one.owners == (0,)  # the reliable tier owns the state
    two = roles([0, 1, 2], [0], stage=2)
    assert two.compute == (0, 1, 2) and two.owners == (1, 2)  # transient owners, everyone computes
    three = roles([0, 1, 2], [0], stage=3)
    assert three.compute == (1, 2) and three.owners == (1, 2)  # the reliable tier only keeps backups
    assert roles([0], [0], stage=3).stage == 1  # nothing transient left: the reliable tier does it all
    with pytest.raises(ValueError, match="reliable"):
        roles([1, 2], [0])


@given(numel=st.integers(1, 10_000), owners=st.integers(1, 64))
def test_shards_cover_every_element_once_and_evenly(numel: int, owners: int) -> None:
    bounds = shard_bounds(numel, owners)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
