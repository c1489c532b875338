"""Emulated links, devices and faults, measured with real workers (root only: skipped elsewhere)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from emulation import (
    barriers_forever,
    cgroup_samples,
    gaps,
    longest_send,
    loop_seconds,
    measured_within,
    needs_root,
    routes,
    send_seconds,
)

from conveyor.emulate import Emulation, EmulationError, WorkerRevoked, launch_emulated
from conveyor.emulate._privileges import require_netem
from conveyor.emulate.parts import cpu_loop_seconds

pytestmark = [needs_root, pytest.mark.timeout(120), pytest.mark.serial]  # rates and durations: alone


def test_a_100_mbit_link_carries_50_mb_in_4_s() -> None:
    seconds = launch_emulated(send_seconds, 50_000_000, nprocs=2, emulation=Emulation(network="2:1.25e7"))[0]
    assert seconds == pytest.approx(4.0, rel=0.10)


def test_a_worker_reaches_only_the_emulated_network() -> None:
    tables = launch_emulated(routes, nprocs=2, emulation=Emulation(network="2:1.25e9"))
    for table in tables.values():  # one route, to the job's own subnet, on its one interface: no way out
        assert table.split() == [
            "10.77.0.0/16",
            "dev",
            "eth0",
            "proto",
            "kernel",
            "scope",
            "link",
            "src",
            table.split()[-1],
        ]
        assert table.split()[-1] in ("10.77.0.1", "10.77.0.2")


def test_the_slow_level_between_servers_sets_the_rate() -> None:
    # Workers 0 and 1 are on different servers: 12.5 MB/s between them, 1.25 GB/s inside each.
    seconds = launch_emulated(send_seconds, 12_500_000, nprocs=2, emulation=Emulation(network="1:1.25e9,2:1.25e7"))[0]
    assert seconds == pytest.approx(1.0, rel=0.15)


def test_latency_delays_a_small_message() -> None:
    try:
        require_netem()
    except EmulationError as exc:
        pytest.skip(str(exc))
    base = launch_emulated(send_seconds, 4, nprocs=2, emulation=Emulation(network="2:1.25e9"))[0]
    delayed = launch_emulated(send_seconds, 4, nprocs=2, emulation=Emulation(network="2:1.25e9/10ms"))[0]
    assert delayed - base == pytest.approx(0.020, abs=0.004)  # there and back, 10 ms each


def test_latency_without_netem_is_one_line() -> None:
    try:
        require_netem()
    except EmulationError:
        with pytest.raises(EmulationError, match=r"^this kernel has no netem[^\n]*drop the /LATENCY"):
            launch_emulated(send_seconds, 4, nprocs=2, emulation=Emulation(network="2:1.25e9/10ms"))
    else:
        pytest.skip("this kernel has netem: latency is emulated (test_latency_delays_a_small_message)")


def test_a_quarter_core_is_four_times_slower_than_a_whole_one() -> None:
    # The quota holds exactly: the worker runs a quarter of the wall-clock time. Its speed against a whole
    # core's is looser: each stop costs work (cold caches), and the host's noise moves both (on CI's VM it
    # once read 6.4x), so the two are measured again, up to three times, while the speed is out.
    cpu_loop_seconds(50)
    iterations = max(1, round(1.0 / (cpu_loop_seconds(200) / 200)))  # a second on a whole core

    def measure() -> tuple[tuple[float, float], tuple[float, float]]:
        fast, slow = launch_emulated(loop_seconds, iterations, nprocs=2, emulation=Emulation(devices="1,0.25")).values()
        return fast, slow

    fast, slow = measured_within(measure, lambda m: m[1][0] / m[0][0] == pytest.approx(4.0, rel=0.25))
    assert slow[1] / slow[0] == pytest.approx(0.25, rel=0.10)
    assert slow[0] / fast[0] == pytest.approx(4.0, rel=0.25)


@pytest.mark.parametrize(
    ("fault", "changed", "share"),
    [("slow:worker=1,at=1.5,for=3,cores=0.25", (0.25, 1), 0.25), ("load:worker=1,at=1.5,for=3", (1.0, 2), 0.5)],
)
def test_a_straggler_runs_slower_for_its_period(fault: str, changed: tuple[float, int], share: float, tmp_path) -> None:
    # What the worker sees of its own cgroup, loop after loop: its quota cut to a quarter core, or a competing
    # busy process beside it (FlexRR's disrupted machine), for one unbroken stretch that matches the fault's
    # logged begin and end, then as before. The loop runs until the worker has seen the fault end, so no speed
    # of the machine can outrun the fault. While slowed, the worker runs at most its share of a core: a bound the
    # kernel enforces whatever else the host does (its noise can only lower the share); 20% over it allows one
    # period's run more (25 ms of 3 s) and the scheduler's accounting.
    iterations = max(1, round(0.02 / (cpu_loop_seconds(100) / 100)))  # 20 ms loops on a whole core
    emulation = Emulation(devices="1,1", faults=fault)
    samples = launch_emulated(cgroup_samples, 1, iterations, 60.0, nprocs=2, emulation=emulation, log_dir=tmp_path)[1]
    states = [(cores, procs) for *_, cores, procs in samples]
    runs = [(state, len(list(group))) for state, group in itertools.groupby(states)]
    assert [state for state, _ in runs] == [(1.0, 1), changed, (1.0, 1)], runs  # base, fault, base: in one piece
    log = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["begin", "end"]
    assert log[1]["t"] - log[0]["t"] == pytest.approx(3.0, abs=0.1)
    first = next(i for i, s in enumerate(samples) if (s[3], s[4]) == changed)
    slowed = samples[first : first + runs[1][1]]
    # causal, so free of margins: a read of the base state came before the change, which the driver logs after
    # making it; a read of the changed state came before the restore, logged after it
    assert samples[first - 1][0] <= log[0]["wall"] and slowed[-1][0] <= log[1]["wall"]
    # over the whole stretch (a quota holds per period, and one short loop may fit in a period's run)
    cpu = sum(s[2] for s in slowed[1:])  # the first loop began before the fault
    assert cpu / (slowed[-1][0] - slowed[0][0]) <= share * 1.2


# A fault's clock starts once every worker has finished its set-up, before the process group's rendezvous,
# which a loaded host can stretch past the fault (on CI's VM a 2 s link-down once held no send): the run is
# measured again, up to three times, while the fault missed the work.


def test_a_pause_stops_the_worker_for_its_duration(tmp_path) -> None:
    emulation = Emulation(faults="pause:worker=1,at=1,for=1.5")
    longest = measured_within(
        lambda: launch_emulated(gaps, 4.0, nprocs=2, emulation=emulation, log_dir=tmp_path),
        lambda gaps_seen: gaps_seen[1] > 1.0,
    )
    assert longest[0] < 0.5 and longest[1] == pytest.approx(1.5, abs=0.3)
    log = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(e["event"], e["kind"]) for e in log] == [("begin", "pause"), ("end", "pause")]
    assert log[1]["t"] - log[0]["t"] == pytest.approx(1.5, abs=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faults.jsonl"]  # the workers' markers are gone


def test_a_cut_link_holds_a_transfer_until_it_is_back(tmp_path) -> None:
    # 1.25 MB at 12.5 MB/s takes 0.1 s, but not while the link between the servers is down (2 s).
    emulation = Emulation(network="1:1.25e9,2:1.25e7", faults="link-down:server=0,at=1.5,for=2")
    longest = measured_within(
        lambda: launch_emulated(longest_send, 1_250_000, 5.0, nprocs=2, emulation=emulation, log_dir=tmp_path)[0],
        lambda seconds: seconds > 1.5,
    )
    assert longest > 1.5
    log = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(e["event"], e["kind"], e["server"]) for e in log] == [("begin", "link-down", 0), ("end", "link-down", 0)]


def test_a_revoked_worker_gets_notice_then_is_killed_and_the_job_says_so(tmp_path, capfd) -> None:
    emulation = Emulation(faults="revoke:worker=1,at=2,grace=1.5")
    with pytest.raises(
        WorkerRevoked, match=r"worker 1 was revoked by the emulated cluster \(notice at 2\.\d s, killed at"
    ):
        launch_emulated(barriers_forever, nprocs=2, emulation=emulation, log_dir=tmp_path, timeout_s=60)
    assert re.search(r"worker 1: revocation notice: SIGKILL in 1.5 s", capfd.readouterr().err)
    log = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["begin", "killed"]
    assert log[1]["t"] - log[0]["t"] == pytest.approx(1.5, abs=0.1)
