"""Parsing hierarchical topologies."""

import pytest

from conveyor.plan._topology import Level, Topology, TopologyError


def test_levels_innermost_first() -> None:
    t = Topology.parse("4:12e9, 4:1.25e9")
    assert t.levels == (Level(4, 12e9), Level(4, 1.25e9))
    assert t.workers == 16
    assert Topology.parse(str(t)) == t


@pytest.mark.parametrize("text", ["4", "4:fast", "x:1e9", "0:1e9", "4:0", "4:-1e9", "4:inf", ""])
def test_bad_topologies_say_how_to_write_one(text: str) -> None:
    with pytest.raises(TopologyError, match=r"COUNT:BYTES_PER_S|count >= 1"):
        Topology.parse(text)


def test_latency_per_level_in_seconds_milliseconds_or_microseconds() -> None:
    t = Topology.parse("2:1.25e9/0.1ms,2:1.25e7/5ms")
    assert [lv.latency for lv in t.levels] == pytest.approx([1e-4, 5e-3])
    assert Topology.parse(str(t)) == t
    assert Topology.parse("2:1e9/2e-4").levels[0].latency == 2e-4
    assert t.level_between(0, 1) == t.levels[0] and t.level_between(1, 2) == t.levels[1]


@pytest.mark.parametrize("text", ["2:1e9/fast", "2:1e9/5min", "2:1e9/-1ms"])
def test_bad_latencies(text: str) -> None:
    with pytest.raises(TopologyError, match=r"LATENCY|latency >= 0"):
        Topology.parse(text)
