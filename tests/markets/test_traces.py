"""Market traces: SkyPilot's JSON counts read, checked in one line, aligned into trace sets."""

import json
from pathlib import Path

import numpy as np
import pytest

from conveyor.errors import InputError
from conveyor.markets import read_market_trace, read_trace_set


def _write(folder: Path, name: str, data: object, gap: object = 60) -> Path:
    path = folder / name
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": data}))
    return path


def test_a_trace_reads_its_zone_kind_tick_and_counts(tmp_path: Path) -> None:
    t = read_market_trace(_write(tmp_path, "us-west-2b_k80_8.json", [0, 2, 1, 3]))
    assert (t.zone, t.region, t.instance, t.gap_s) == ("us-west-2b", "us-west-2", "k80_8", 60.0)
    assert t.counts.tolist() == [0, 2, 1, 3] and t.drops == 1


@pytest.mark.parametrize(
    ("name", "data", "gap", "says"),
    [
        ("noname.json", [1, 1], 60, "expected a name ZONE_TYPE_COUNT.json"),
        ("us-east-1a_v100_1.json", [1, 0.5], 60, "tick 1 is 0.5"),
        ("us-east-1a_v100_1.json", [1, True], 60, "tick 1 is True"),
        ("us-east-1a_v100_1.json", [1], 60, "at least 2 counts"),
        ("us-east-1a_v100_1.json", [1, 1], 0, "gap_seconds must be > 0"),
        ("us-east-1a_v100_1.json", [1, 1], "x", "expected {"),
    ],
)
def test_a_malformed_trace_is_refused_in_one_line(
    tmp_path: Path, name: str, data: object, gap: object, says: str
) -> None:
    path = _write(tmp_path, name, data, gap)
    with pytest.raises(InputError) as error:
        read_market_trace(path)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "us-east-1a_v100_1.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match=r"us-east-1a_v100_1\.json: expected"):
        read_market_trace(path)


def test_a_set_is_sorted_filtered_and_cut_to_its_shortest_trace(tmp_path: Path) -> None:
    _write(tmp_path, "us-west-2b_v100_1.json", [1, 1, 1, 0, 1])
    _write(tmp_path, "us-west-2a_v100_1.json", [1, 0, 1])
    _write(tmp_path, "us-west-2a_k80_1.json", [1, 1, 1, 1])
    traces = read_trace_set(tmp_path, ("v100_1",))
    assert [t.name for t in traces] == ["us-west-2a_v100_1", "us-west-2b_v100_1"]
    assert all(len(t.counts) == 3 for t in traces)
    assert np.array_equal(traces[1].counts, [1, 1, 1])


def test_a_set_of_different_ticks_or_no_traces_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is not a folder"):
        read_trace_set(tmp_path / "missing")
    with pytest.raises(InputError, match=r"has no ZONE_TYPE_N\.json traces"):
        read_trace_set(tmp_path)
    _write(tmp_path, "a1a_v100_1.json", [1, 1], gap=60)
    _write(tmp_path, "a1b_v100_1.json", [1, 1], gap=600)
    with pytest.raises(InputError, match="different ticks"):
        read_trace_set(tmp_path)
