"""Spot-availability traces replayed as machines taking and leaving worker slots."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.emulate._traces import replay_trace


def test_an_event_trace_gives_each_machine_the_lowest_free_slot(tmp_path: Path) -> None:
    trace = tmp_path / "events.csv"
    trace.write_text("1000,add,a\r\n1000,add,b\r\n5000,remove,a\r\n7000,add,c\r\n9000,add,d\r\n")
    # Times from the first line; c takes a's freed slot 0, d the next new one.
    assert replay_trace(trace) == [
        (0.0, "add", 0),
        (0.0, "add", 1),
        (4.0, "remove", 0),
        (6.0, "add", 0),
        (8.0, "add", 2),
    ]


def test_a_count_trace_removes_the_highest_slots_and_fills_the_lowest(tmp_path: Path) -> None:
    trace = tmp_path / "counts.txt"
    trace.write_text(
        "2021-12-01, 00:00:00, 3\n2021-12-01, 00:01:00, 1\n2021-12-01, 00:00:30, 1\n2021-12-01, 00:03:00, 2\n"
    )
    # The repeated count stamped earlier changes nothing; a change is never placed before the one before it.
    assert replay_trace(trace) == [
        (0.0, "add", 0),
        (0.0, "add", 1),
        (0.0, "add", 2),
        (60.0, "remove", 2),
        (60.0, "remove", 1),
        (180.0, "add", 1),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [("", r"trace t.csv is empty"), ("1000,add\n", r"line 1 '1000,add': expected"), ("0,remove,x\n", r"removes x")],
)
def test_bad_traces_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(ValueError, match=message):
        replay_trace(trace)


def test_a_skypilot_trace_is_replayed_as_counts_every_tick(tmp_path: Path) -> None:
    trace = tmp_path / "us-west-2a_v100_1.json"
    trace.write_text('{"metadata": {"gap_seconds": 300}, "data": [2, 2, 0, 1]}')
    assert replay_trace(trace) == [
        (0.0, "add", 0),
        (0.0, "add", 1),
        (600.0, "remove", 1),
        (600.0, "remove", 0),
        (900.0, "add", 0),
    ]
