"""Fault plans: scripted events, FlexRR's straggler patterns, random revocations and spot-trace replays."""

from __future__ import annotations

import datetime
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.emulate._faults import KINDS, Fault, parse_faults
from conveyor.errors import InputError

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "spot-traces"


def trace(name: str) -> Path:
    path = TRACES / name
    if not path.is_file():
        pytest.skip(f"spot trace {path} not found (only CI and developer machines have ../shared/spot-traces)")
    return path


def replay(faults: list[Fault], start: set[int]) -> list[tuple[float, set[int]]]:
    """The live ranks after each event, checking that only live ranks are revoked and only dead ones added."""
    live, states = set(start), []
    for f in faults:
        for w in f.workers:
            if f.kind == "revoke":
                assert w in live, f"{f} revokes a rank that is not live"
                live.discard(w)
            elif f.kind == "add":
                assert w not in live, f"{f} adds a rank that is live"
                live.add(w)
        states.append((f.at, set(live)))
    return states


# --- scripted events and JSON files ---------------------------------------------------------------------------------


def test_empty_spec_gives_no_events() -> None:
    assert parse_faults("", 4) == []
    assert parse_faults(" ; \n ;", 4) == []


def test_scripted_events_expand_servers_and_sort() -> None:
    faults = parse_faults(
        "revoke:server=1,at=10,grace=30; slow:worker=1,at=2,for=3,cores=0.25; link-down:server=0,at=5,for=2;"
        "pause:worker=0,at=2,for=1; load:server=2,at=2; add:worker=3,at=10",
        workers=6,
        per_server=2,
    )
    assert [(f.at, f.kind, f.workers) for f in faults] == [
        (2.0, "slow", (1,)),
        (2.0, "pause", (0,)),
        (2.0, "load", (4, 5)),
        (5.0, "link-down", ()),
        (10.0, "revoke", (2, 3)),  # a revoke sorts before an add at the same instant
        (10.0, "add", (3,)),
    ]
    slow, link, revoke = faults[0], faults[3], faults[4]
    assert (slow.duration, slow.cores, slow.source) == (3.0, 0.25, "slow:worker=1,at=2,for=3,cores=0.25")
    assert (link.server, link.duration) == (0, 2.0)
    assert revoke.grace == 30.0
    assert faults[2].duration == 0.0  # no for=: until the job ends


def test_last_server_may_be_partial() -> None:
    assert parse_faults("pause:server=2,at=1", workers=5, per_server=2)[0].workers == (4,)


def test_events_beyond_the_horizon_are_dropped() -> None:
    faults = parse_faults("pause:worker=0,at=50; pause:worker=1,at=150", 2, horizon_s=100)
    assert [f.workers for f in faults] == [(0,)]


def test_json_file_round_trip(tmp_path: Path) -> None:
    spec = "slow:worker=1,at=2,for=3,cores=0.5; link-down:server=1,at=5,for=2; revoke:worker=0,at=7,grace=4"
    faults = parse_faults(spec, workers=4, per_server=2)
    path = tmp_path / "faults.json"
    path.write_text(json.dumps([f.to_dict() for f in faults]))
    assert parse_faults(str(path), workers=4, per_server=2) == faults
    # Hand-written dicts need only at and kind (and the fields their kind uses); the file names their source.
    path.write_text(json.dumps([{"at": 1, "kind": "pause", "workers": [3, 2]}]))
    (loaded,) = parse_faults(str(path), 4)
    assert (loaded.workers, loaded.source) == ((2, 3), "json:faults.json")


@given(
    kind=st.sampled_from(KINDS),
    rank=st.integers(0, 7),
    at=st.floats(0, 3000, allow_nan=False),
    duration=st.floats(0, 100, allow_nan=False),
    cores=st.floats(0.01, 8, allow_nan=False),
    grace=st.floats(0, 60, allow_nan=False),
)
def test_any_scripted_event_round_trips_through_json(
    kind: str, rank: int, at: float, duration: float, cores: float, grace: float
) -> None:
    keys = {"at": at, "server" if kind == "link-down" else "worker": rank % 4 if kind == "link-down" else rank}
    if kind in ("slow", "pause", "load", "link-down"):
        keys["for"] = duration
    keys |= {"cores": cores} if kind == "slow" else {"grace": grace} if kind == "revoke" else {}
    text = f"{kind}:" + ",".join(f"{k}={v!r}" for k, v in keys.items())
    (fault,) = parse_faults(text, workers=8, per_server=2)
    assert fault.at == pytest.approx(at, abs=1e-6)
    assert Fault.from_dict(json.loads(json.dumps(fault.to_dict()))) == fault


# --- FlexRR's patterns -----------------------------------------------------------------------------------------------


def test_rotating_slow_keeps_exactly_one_worker_slow() -> None:
    faults = parse_faults("rotating-slow:factor=0.25,period=5,seed=3,cores=2", workers=4, horizon_s=1000)
    assert len(faults) == 200
    assert all(f.kind == "slow" and len(f.workers) == 1 and f.cores == 0.5 for f in faults)
    # Back to back, each lasting one period: exactly one worker slow at any time in [0, horizon).
    assert faults[0].at == 0
    assert all(a.at + a.duration == pytest.approx(b.at) for a, b in itertools.pairwise(faults))
    assert all(a.workers != b.workers for a, b in itertools.pairwise(faults))
    assert {f.workers[0] for f in faults} == {0, 1, 2, 3}


def test_patterns_among_the_first_workers_spare_the_rest() -> None:
    slow = parse_faults("rotating-slow:factor=0.5,period=1,seed=2,among=2", workers=3, horizon_s=50)
    pauses = parse_faults("power-law:alpha=1.5,scale=0.1,period=1,seed=2,among=2", workers=3, horizon_s=50)
    assert {f.workers[0] for f in slow} == {0, 1} and {f.workers[0] for f in pauses} == {0, 1}
    assert len(pauses) == 2 * 50  # each of the two pauses once a period


def test_rotating_slow_with_one_worker_and_until() -> None:
    faults = parse_faults("rotating-slow:factor=0.5,period=10,until=30", workers=1)
    assert [(f.at, f.workers) for f in faults] == [(0.0, (0,)), (10.0, (0,)), (20.0, (0,))]


def test_disrupted_loads_every_worker_of_the_server() -> None:
    (fault,) = parse_faults("disrupted:server=1,at=5,for=20", workers=8, per_server=4)
    assert (fault.kind, fault.workers, fault.at, fault.duration) == ("load", (4, 5, 6, 7), 5.0, 20.0)
    (one,) = parse_faults("disrupted:worker=6,at=5,for=20", workers=8, per_server=4)
    assert one.workers == (6,)


def test_random_disruptions_take_whole_servers_one_at_a_time() -> None:
    faults = parse_faults("disrupted:for=20,period=60,seed=2", workers=8, per_server=2, horizon_s=6000)
    assert len(faults) == 100
    servers = [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(f.kind == "load" and f.workers in servers and f.duration == 20 for f in faults)
    assert {f.workers for f in faults} == set(servers)
    assert all(a.at + a.duration <= b.at for a, b in itertools.pairwise(faults))


def hill(samples: np.ndarray, k: int) -> float:
    """Hill's estimator of the tail exponent from the k largest samples."""
    top = np.sort(samples)[::-1][: k + 1]
    return float(k / np.sum(np.log(top[:k] / top[k])))


def test_power_law_pauses_have_a_power_law_tail() -> None:
    alpha, scale = 1.5, 0.01
    faults = parse_faults(f"power-law:alpha={alpha},scale={scale},period=100,seed=7", workers=10, horizon_s=40_000)
    assert len(faults) == 4000 and all(f.kind == "pause" and f.duration <= 100 for f in faults)
    # Every period, every worker pauses once, at a random moment, ending within the period.
    in_period = [f for f in faults if 300 <= f.at < 400]
    assert sorted(f.workers for f in in_period) == [(w,) for w in range(10)]
    assert all(f.at + f.duration <= 400 + 1e-9 for f in in_period) and len({f.at for f in in_period}) == 10
    durations = np.array([f.duration for f in faults])
    assert durations.min() >= scale
    k = 400
    assert hill(durations, k) == pytest.approx(alpha, rel=0.2)
    # The check has teeth: an exponential with the same minimum and mean is far from it.
    exponential = scale + np.random.default_rng(0).exponential(scale * alpha / (alpha - 1) - scale, 4000)
    assert hill(exponential, k) != pytest.approx(alpha, rel=0.2)


def test_random_revoke_rate_and_no_rank_twice() -> None:
    faults = parse_faults("random-revoke:rate=0.5,grace=30,seed=4", workers=2000, horizon_s=1000)
    ranks = [f.workers[0] for f in faults]
    assert len(set(ranks)) == len(ranks)
    assert all(f.kind == "revoke" and len(f.workers) == 1 and f.grace == 30 for f in faults)
    assert len(faults) == pytest.approx(500, abs=5 * math.sqrt(500))  # Poisson: mean 500, sd 22


def test_random_revoke_whole_servers_until_none_left() -> None:
    faults = parse_faults("random-revoke:rate=1,server=1,seed=1", workers=6, per_server=2)
    assert sorted(f.workers for f in faults) == [(0, 1), (2, 3), (4, 5)]


@pytest.mark.parametrize(
    "spec",
    [
        "rotating-slow:factor=0.5,period=7,seed={}",
        "disrupted:for=5,period=30,seed={}",
        "power-law:alpha=2,scale=0.5,period=10,seed={}",
        "random-revoke:rate=0.05,seed={}",
    ],
)
def test_seeds_reproduce_and_differ(spec: str) -> None:
    def run(seed: int) -> list[Fault]:
        return parse_faults(spec.format(seed), workers=8, per_server=2, horizon_s=600)

    assert run(1) == run(1)
    assert run(1) != run(2)


# --- spot traces -----------------------------------------------------------------------------------------------------


def p3_brute_force(path: Path, machines: int, offset: float) -> tuple[set[int], list[tuple[float, str, int]]]:
    """The p3 trace replayed the obvious way: machines take the lowest free slot; slots >= machines dropped."""
    slot_of: dict[str, int] = {}
    start: set[int] = set()
    events = []
    for line in path.read_text().split():
        ms, op, name = line.split(",")
        t = int(ms) / 1000
        if op == "add":
            slot_of[name] = min(set(range(1000)) - set(slot_of.values()))
            slot = slot_of[name]
        else:
            slot = slot_of.pop(name)
        if slot >= machines:
            continue
        if t <= offset:
            (start.add if op == "add" else start.discard)(slot)
        else:
            events.append((t - offset, "add" if op == "add" else "revoke", slot))
    return start, events


@pytest.mark.parametrize("offset", [0, 7200])
def test_p3_trace_matches_a_brute_force_replay(offset: int) -> None:
    path = trace("p3-trace.csv")
    faults = parse_faults(f"trace:{path},time-scale=3600,offset={offset},machines=4,grace=30", workers=6)
    start, expected = p3_brute_force(path, 4, offset)
    at_zero = [f for f in faults if f.at == 0 and f.kind == "revoke" and f.grace == 0]
    assert {f.workers[0] for f in at_zero} == set(range(4)) - start  # slots with no machine at the start
    rest = [f for f in faults if f not in at_zero]
    assert all(f.source == "trace:p3-trace.csv" and f.workers[0] < 4 for f in faults)
    assert all(f.grace == 30 for f in rest if f.kind == "revoke")
    got = sorted((f.at, f.kind, f.workers[0]) for f in rest)
    want = sorted((round(t / 3600, 6), kind, slot) for t, kind, slot in expected)
    assert got == want
    assert len(rest) > 10
    states = replay(faults, set(range(4)))
    assert all(len(live) <= 4 for _, live in states)


def test_p3_trace_at_one_to_one_time_respects_the_horizon() -> None:
    faults = parse_faults(f"trace:{trace('p3-trace.csv')},machines=4", workers=4, horizon_s=3600)
    assert faults and max(f.at for f in faults) <= 3600
    assert len(faults) < len(parse_faults(f"trace:{trace('p3-trace.csv')},machines=4", workers=4, horizon_s=1e6))


def test_g4dn_trace_starts_with_its_first_machine() -> None:
    # Its first machine arrives 480 s after the trace's zero: the trace starts there, with one machine.
    faults = parse_faults(f"trace:{trace('g4dn-trace.csv')},time-scale=60,machines=3", workers=3)
    assert [(f.at, f.kind, f.workers) for f in faults[:5]] == [
        (0.0, "revoke", (1,)),
        (0.0, "revoke", (2,)),
        (1.0, "add", (1,)),
        (2.0, "add", (2,)),
        (16.0, "revoke", (2,)),
    ]


def gcp_counts(path: Path) -> list[tuple[float, int]]:
    """(seconds from the first sample, live count) at each change of the count, in file order."""
    changes: list[tuple[float, int]] = []
    first = None
    for line in path.read_text().splitlines():
        date, time, count = (c.strip() for c in line.split(","))
        t = datetime.datetime.fromisoformat(f"{date}T{time}").timestamp()
        first = t if first is None else first
        if not changes or int(count) != changes[-1][1]:
            changes.append((max(t - first, changes[-1][0] if changes else 0.0), int(count)))
    return changes


@pytest.mark.parametrize(("name", "peak"), [("a100x1-east1b.txt", 64), ("v100x1-east1c.txt", 80)])
def test_gcp_count_trace_keeps_the_live_count(name: str, peak: int) -> None:
    path = trace(name)
    faults = parse_faults(f"trace:{path},time-scale=3600,grace=10", workers=peak + 2)
    changes = gcp_counts(path)
    assert all(f.workers[0] < peak for f in faults)  # ranks beyond the trace's peak are left alone
    states = [(-1.0, set(range(peak + 2))), *replay(faults, set(range(peak + 2)))]
    for t, count in changes:
        live = [s for at, s in states if at <= round(t / 3600, 6) + 1e-9]
        assert len(live[-1]) - 2 == count, f"at trace second {t}"
        # Drops revoke the highest live slots, so the live ones are always the lowest.
        assert live[-1] == set(range(count)) | {peak, peak + 1}
    with pytest.raises(ValueError, match=rf"trace {name}: up to {peak} machines .* {peak - 1} workers.*machines=M"):
        parse_faults(f"trace:{path}", workers=peak - 1)


# --- errors ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("crash:worker=1", r"unknown kind or pattern 'crash'.*slow, pause"),
        ("pause:worker=1,speed=2", r"unknown key 'speed'.*write it like 'pause:worker=1,at=2,for=3'"),
        ("pause:worker=1,at=soon", r"at='soon' is not a number"),
        ("pause:worker=1,at=1,at=2", r"key 'at' given twice"),
        ("pause:worker", r"'worker' is not key=value"),
        ("pause:worker=8", r"worker=8 is out of range: this job's workers are 0..7"),
        ("pause:worker=1.5", r"worker=1.5 must be a whole number"),
        ("load:server=4,at=1", r"server=4 is out of range: this job's servers are 0..3"),
        ("link-down:server=9", r"server=9 is out of range"),
        ("pause:worker=1,at=-1", r"at=-1 must be >= 0"),
        ("pause:worker=1,for=-2", r"for=-2 must be >= 0"),
        ("pause:at=1", r"give exactly one of worker=R or server=S"),
        ("pause:worker=1,server=1", r"give exactly one of worker=R or server=S"),
        ("slow:worker=1,at=1", r"missing cores="),
        ("slow:worker=1,cores=0", r"cores=0 must be > 0"),
        ("link-down:worker=1", r"unknown key 'worker'"),
        ("revoke:worker=1,for=3", r"unknown key 'for'"),
        ("missing.json", r"fault file 'missing.json' not found"),
        ("trace:missing.csv", r"trace file 'missing.csv' not found"),
        ("trace:", r"missing the trace file's path"),
        ("rotating-slow:factor=1.5,period=1", r"factor=1.5 must be below 1"),
        ("rotating-slow:factor=0.5", r"missing period="),
        ("rotating-slow:factor=0.5,period=1,among=9", r"among=9 must be 1 to this job's 8 workers"),
        ("disrupted:server=1,for=3", r"give at=T for one disruption or seed=S"),
        ("disrupted:server=1,at=3,seed=1,for=2", r"give at=T for one disruption or seed=S"),
        ("disrupted:server=1,at=3", r"missing for="),
        ("power-law:alpha=1.5,scale=10,period=10", r"scale=10.0 must be below period=10.0"),
        ("power-law:alpha=0,scale=1,period=10", r"alpha=0 must be > 0"),
        ("random-revoke:rate=1,server=2", r"server= is a flag"),
        ("random-revoke:grace=1", r"missing rate="),
    ],
)
def test_bad_specs_say_what_is_wrong_in_one_line(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        parse_faults(spec, workers=8, per_server=2)
    assert "\n" not in str(error.value)


def test_bad_trace_arguments_and_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"machines=9 must be 1\.\.8"):
        parse_faults(f"trace:{trace('p3-trace.csv')},machines=9", workers=8)
    with pytest.raises(ValueError, match=r"trace p3-trace.csv: up to 32 machines are live at once .* 8 workers"):
        parse_faults(f"trace:{trace('p3-trace.csv')}", workers=8)
    bad = tmp_path / "bad.csv"
    bad.write_text("0,add,node1\n10,explode,node1\n")
    with pytest.raises(ValueError, match=r"trace bad.csv line 2 .*expected MILLISECONDS,add\|remove,NODE"):
        parse_faults(f"trace:{bad}", workers=8)
    bad.write_text("0,add,node1\n10,remove,node2\n")
    with pytest.raises(ValueError, match=r"trace bad.csv line 2: removes node2 that is not live"):
        parse_faults(f"trace:{bad}", workers=8)


def test_bad_json_files(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    for content, match in [
        ("{", r"is not readable JSON"),
        ('{"at": 1}', r"must hold a list of fault dicts"),
        ('[{"at": 1, "kind": "pause", "workers": [9]}]', r"names a rank or server beyond this job's 8 workers"),
        ('[{"at": 1, "kind": "pause", "worker": 1}]', r"unknown keys \['worker'\]"),
    ]:
        path.write_text(content)
        with pytest.raises(ValueError, match=match):
            parse_faults(str(path), workers=8)


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"at": 1, "kind": "explode", "workers": [0]}, r"unknown fault kind 'explode'"),
        ({"kind": "pause", "workers": [0]}, r"missing 'at' or 'kind'"),
        ({"at": -1, "kind": "pause", "workers": [0]}, r"at=-1 must be a finite number >= 0"),
        ({"at": "1", "kind": "pause", "workers": [0]}, r"at='1' must be a finite number"),
        ({"at": 1, "kind": "pause", "workers": 0}, r"workers must be a list"),
        ({"at": 1, "kind": "pause", "workers": [-1]}, r"must be ints"),
        ({"at": 1, "kind": "pause"}, r"give the ranks in workers"),
        ({"at": 1, "kind": "link-down", "workers": [0]}, r"give server=S"),
        ({"at": 1, "kind": "slow", "workers": [0]}, r"slow fault: needs cores > 0"),
        ({"at": 1, "kind": "pause", "workers": [0], "cores": 1}, r"takes no cores"),
        ({"at": 1, "kind": "pause", "workers": [0], "grace": 1}, r"grace goes with revoke faults only"),
        ({"at": 1, "kind": "add", "workers": [0], "duration": 1}, r"an instant event has no duration"),
        ([1, 2], r"must be a JSON object"),
    ],
)
def test_from_dict_rejects_bad_dicts(d: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as error:
        Fault.from_dict(d)
    assert "\n" not in str(error.value)


def test_bad_job_shape() -> None:
    with pytest.raises(ValueError, match=r"parse_faults needs workers, per_server >= 1"):
        parse_faults("", workers=0)


def test_a_trace_can_govern_the_workers_after_the_reliable_ones(tmp_path: Path) -> None:
    """SkyPilot counts every 300 s: slot s is rank 1 + s; a slot empty at the start is revoked at once."""
    path = tmp_path / "us-west-2a_v100_1.json"
    path.write_text('{"metadata": {"gap_seconds": 300}, "data": [1, 1, 2, 0]}')
    faults = parse_faults(f"trace:{path},time-scale=60,machines=2,first=1", workers=3)
    assert [(f.at, f.kind, f.workers) for f in faults] == [
        (0.0, "revoke", (2,)),
        (10.0, "add", (2,)),
        (15.0, "revoke", (1,)),
        (15.0, "revoke", (2,)),
    ]
    with pytest.raises(InputError, match=r"machines=3 must be 1\.\.2"):
        parse_faults(f"trace:{path},machines=3,first=1", workers=3)
