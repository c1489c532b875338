"""Workers are numbered stage by stage; layouts are written PipeDream's way."""

import pytest

from conveyor.schedule import check_replicas, parse_replicas, stage_workers, worker_stages


def test_workers_are_numbered_stage_by_stage() -> None:
    assert worker_stages([2, 1, 3]) == (0, 0, 1, 2, 2, 2)
    assert stage_workers([2, 1, 3]) == [[0, 1], [2], [3, 4, 5]]


def test_replicas_default_to_one_per_stage() -> None:
    assert check_replicas(3, None) == (1, 1, 1)
    with pytest.raises(ValueError, match="each of the 2 stages a count >= 1"):
        check_replicas(2, [1])
    with pytest.raises(ValueError, match="each of the 2 stages a count >= 1"):
        check_replicas(2, [1, 0])


def test_parse_replicas() -> None:
    assert parse_replicas("15-1") == [15, 1]
    assert parse_replicas("3", stages=1) == [3]
    with pytest.raises(ValueError, match="not a list of counts like 2-1"):
        parse_replicas("two-1")
    with pytest.raises(ValueError, match="not a list of counts like 2-1"):
        parse_replicas("2--1")
    with pytest.raises(ValueError, match=r"must give each of the 3 stages a worker count >= 1, e\.g\. 2-1-1"):
        parse_replicas("2-1", stages=3)
    with pytest.raises(ValueError, match="a worker count >= 1"):
        parse_replicas("0-1")
