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
