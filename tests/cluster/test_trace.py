"""Gavel's trace format: round trips, Gavel's own lines, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cluster._throughputs import ThroughputTable
from conveyor.cluster._trace import TraceJob, format_line, parse_line, read_trace, write_trace

TABLE = ThroughputTable.from_dict(
    {"v100": {"('ResNet-18 (batch size 16)', 1)": {"null": 30.0}, "('A3C', 1)": {"null": 5.0}}}, source="tiny.json"
)

text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\t\r\n"), min_size=1, max_size=20)
jobs = st.builds(
    TraceJob,
    job_type=text,
    total_steps=st.integers(1, 10**12),
    scale_factor=st.sampled_from([1, 2, 4, 8]),
    arrival_s=st.one_of(st.integers(0, 10**9), st.floats(0, 1e9, allow_nan=False)),
    priority_weight=st.one_of(st.sampled_from([1.0, 5.0]), st.floats(1e-3, 1e3)),
    slo=st.one_of(st.none(), st.sampled_from([1.2, 2.0, 10.0]), st.floats(1e-3, 1e3)),
    command=text,
    working_directory=text,
    num_steps_arg=text,
    needs_data_dir=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(jobs, max_size=5))
def test_write_then_read_gives_the_same_jobs(tmp_path_factory: pytest.TempPathFactory, trace: list[TraceJob]) -> None:
    path = tmp_path_factory.mktemp("trace") / "trace.txt"
    write_trace(trace, path)
    assert read_trace(path) == trace
    assert [parse_line(format_line(job)) for job in trace] == trace


def gavel_parse(line: str) -> tuple:
    """The conversions Gavel's utils.parse_trace applies to each field (it keeps the rest as text)."""
    f = line.split("\t")
    assert len(f) == 10 and int(f[6]) >= 1
    return f[0], f[1], f[2], f[3], bool(int(f[4])), int(f[5]), int(f[6]), float(f[7]), float(f[8]), float(f[9])


def test_lines_we_write_are_what_gavel_writes_and_reads() -> None:
    job = TraceJob("A3C", 123456, 1, 3600.0, priority_weight=5.0, slo=1.2)
    line = format_line(job)
    assert line == "A3C\tgenerated\t.\t--num_steps\t0\t123456\t1\t5\t1.200000\t3600"
    assert gavel_parse(line) == ("A3C", "generated", ".", "--num_steps", False, 123456, 1, 5.0, 1.2, 3600.0)
    # Values Gavel's %d / %f would round are written exactly, in a form Gavel's float() still reads.
    odd = TraceJob("A3C", 7, 2, 12.345, priority_weight=1.5, slo=1 / 3)
    assert gavel_parse(format_line(odd))[7:] == (1.5, 1 / 3, 12.345)
    assert format_line(TraceJob("A3C", 7, 1, 0.0)).split("\t")[8] == "-1.000000"


def test_a_line_in_gavels_format_parses(tmp_path: Path) -> None:
    # Built the way Gavel's Job.__str__ and scripts/utils/generate_trace.py write a job (fields, then arrival).
    fields = (
        "ResNet-18 (batch size 16)",
        "python3 main.py --data_dir=/data/cifar10 --batch_size 16",
        "image_classification/cifar10",
        "--num_steps",
        True,
        161766.9,
        4,
        1.0,
        -1,
    )
    line = "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%f" % fields + "\t%d\n" % 1234.9  # noqa: UP031
    path = tmp_path / "gavel.trace"
    path.write_text(line + line.replace("\t-1.000000\t", "\t2.000000\t"))
    first, second = read_trace(path, table=TABLE.from_dict({"v100": {"('ResNet-18 (batch size 16)', 4)": {"null": 1}}}))
    assert first == TraceJob(
        "ResNet-18 (batch size 16)",
        161766,
        4,
        1234.0,
        1.0,
        None,
        None,
        "python3 main.py --data_dir=/data/cifar10 --batch_size 16",
        "image_classification/cifar10",
        "--num_steps",
        True,
    )
    assert second.slo == 2.0
    assert path.read_text() == "".join(format_line(j) + "\n" for j in (first, second))  # the same bytes back
    assert parse_line("A3C\tc\tw\t-n\t0\t10\t1\t1\t-1\t17.25\r\n").arrival_s == 17.25  # a float arrival time


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("\n" + format_line(TraceJob("A3C", 1, 1, 0.0)) + "\n\n")
    assert len(read_trace(path)) == 1


BAD = "A3C\tc\tw\t-n\t0\t10\t1\t1\t-1\t0"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("A3C\tc\tw\t-n\t0\t10\t1\t1\t-1", r"t.txt:2: 9 tab-separated fields, Gavel's trace format has 10"),
        (BAD + "\textra", r"t.txt:2: 11 tab-separated fields"),
        (BAD.replace("\t10\t", "\tten\t"), r"t.txt:2: field total_steps is 'ten', not an integer"),
        (BAD.replace("\t10\t", "\t10.5\t"), r"field total_steps is '10.5', not an integer"),
        (BAD.replace("\t1\t1\t", "\tone\t1\t"), r"field scale_factor is 'one', not an integer"),
        (BAD.replace("\t1\t-1", "\thigh\t-1"), r"field priority_weight is 'high', not a number"),
        (BAD.replace("\t-1\t", "\tnone\t"), r"field SLO is 'none', not a number"),
        (BAD[:-1] + "soon", r"field arrival_time is 'soon', not a number"),
        (BAD.replace("\t1\t1\t", "\t0\t1\t"), r"t.txt:2: scale factor 0 < 1; a job uses at least 1 device"),
        (BAD.replace("\t0\t10", "\t2\t10"), r"needs_data_dir is '2'; write 0 or 1"),
        (BAD.replace("\t10\t", "\t0\t"), r"t.txt:2: job 'A3C' has 0 total steps: give at least 1"),
        (BAD[:-1] + "-5", r"arrives at -5.0 s: give a finite time >= 0"),
        (BAD[:-1] + "nan", r"arrives at nan s"),
        (BAD.replace("\t1\t-1", "\t0\t-1"), r"priority weight 0.0: give a number > 0"),
        (BAD.replace("\t-1\t", "\t0\t"), r"SLO 0.0: give a multiple of its duration > 0"),
        ("\tc\tw\t-n\t0\t10\t1\t1\t-1\t0", r"job job_type '' must be non-empty text"),
    ],
)
def test_malformed_lines_say_where_and_how_to_fix(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.txt"
    path.write_text(BAD + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        read_trace(path)
    assert "\n" not in str(info.value)


def test_unknown_types_and_missing_scale_factors(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    write_trace([TraceJob("A3C", 10, 1, 0.0), TraceJob("LM (batch size 5)", 10, 1, 0.0)], path)
    with pytest.raises(
        ValueError,
        match=r"t.txt:2: unknown job type 'LM \(batch size 5\)'; the throughput table "
        r"tiny.json knows 2 types .*use a table that has it",
    ):
        read_trace(path, table=TABLE)
    with pytest.raises(ValueError, match=r"t.txt:1: unknown job type 'A3C'; the given known_types knows 1 types"):
        read_trace(path, known_types=["CycleGAN"])
    assert len(read_trace(path, known_types=["A3C", "LM (batch size 5)"])) == 2
    write_trace([TraceJob("A3C", 10, 1, 0.0), TraceJob("ResNet-18 (batch size 16)", 10, 8, 0.0)], path)
    with pytest.raises(
        ValueError,
        match=r"t.txt:2: the throughput table tiny.json has no throughput for "
        r"'ResNet-18 \(batch size 16\)' on 8 devices \(it has scale factors \[1\]\)",
    ):
        read_trace(path, table=TABLE)


def test_jobs_reject_what_the_format_cannot_hold() -> None:
    with pytest.raises(ValueError, match="command 'a\\\\tb' must be non-empty text without tabs"):
        TraceJob("A3C", 1, 1, 0.0, command="a\tb")
    with pytest.raises(ValueError, match=r"has total_steps 1\.5: give a whole number"):
        TraceJob("A3C", 1.5, 1, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale factor 0: a job uses at least 1 device"):
        TraceJob("A3C", 1, 0, 0.0)
    assert TraceJob("A3C", 10.0, 2, 0) == TraceJob("A3C", 10, 2, 0.0)  # type: ignore[arg-type]
