"""The emulated network's wiring, devices and inputs, checked without building anything."""

from __future__ import annotations

import pytest

from conveyor.emulate import Emulation, EmulationError, address, link_pairs, links_of, parse_devices
from conveyor.emulate import _privileges as privileges
from conveyor.plan import Topology


def test_every_worker_and_every_group_below_the_top_gets_a_link() -> None:
    links = links_of(Topology.parse("2:1e9/1ms,2:1e8/3ms,2:1e7/7ms"))
    assert [(link.level, link.group) for link in links] == [(0, r) for r in range(8)] + [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 1),
    ]
    # One-way latency of a message joined at level k is latency_k: each link adds half the step, both ends.
    delay = {link.level: link.delay_s for link in links}
    assert 2 * delay[0] == pytest.approx(1e-3)
    assert 2 * (delay[0] + delay[1]) == pytest.approx(3e-3)
    assert 2 * (delay[0] + delay[1] + delay[2]) == pytest.approx(7e-3)


def test_an_outer_level_faster_than_an_inner_one_in_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="outer level's latency"):
        links_of(Topology.parse("2:1e9/5ms,2:1e8/1ms"))


def test_link_pairs_cross_every_link() -> None:
    topology = Topology.parse("2:1e9,3:1e8")
    pairs = link_pairs(topology)
    assert {a for a, _ in pairs} | {b for _, b in pairs} == set(range(6))
    between = [(a, b) for a, b in pairs if topology.level_between(a, b) is topology.levels[1]]
    assert between == [(0, 2), (2, 4), (4, 0)]


def test_addresses_are_distinct_and_private() -> None:
    addresses = [address(r) for r in range(1000)]
    assert len(set(addresses)) == 1000 and all(a.startswith("10.77.") for a in addresses)


def test_devices_by_count_and_by_type() -> None:
    assert [d.cores for d in parse_devices("1,1,0.5,0.5", 4)] == [1, 1, 0.5, 0.5]
    assert [d.name for d in parse_devices("fast=1.0:2,slow=0.25:2", 4)] == ["fast", "fast", "slow", "slow"]


@pytest.mark.parametrize(
    ("emulation", "message"),
    [
        (Emulation(network="3:1e9"), r"^--network 3:1e9 has 3 workers but the job has 4$"),
        (Emulation(network="4:fast"), r"^--network: cannot read topology level"),
        (Emulation(devices="1,x"), r"^cannot read device 'x'"),
        (Emulation(devices="1,1"), r"^--devices '1,1' describes 2 workers but the job has 4$"),
        (Emulation(devices="0,1,1,1"), r"^device '0' needs cores > 0"),
        (
            Emulation(devices="1", cpu_slice=0.0001),
            r"^--cpu-slice is 0.001 to 1 second \(the kernel's quota\), got 0.0001$",
        ),
        (Emulation(faults="pause:worker=7,at=1,for=1"), r"7"),
        (Emulation(faults="link-down:server=0,at=1,for=1"), r"^a link-down fault needs --network with at least two"),
    ],
)
def test_bad_input_is_one_line(emulation: Emulation, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        emulation.check(4)
    assert "\n" not in str(caught.value)


def test_a_trace_naming_more_machines_than_workers_is_one_line() -> None:
    from pathlib import Path

    trace = Path(__file__).resolve().parents[3] / "shared" / "spot-traces" / "p3-trace.csv"
    if not trace.exists():
        pytest.skip(f"spot traces not found at {trace.parent} (only CI and developer machines have ../shared)")
    with pytest.raises(ValueError, match=r"machines are live at once but the job has 4 workers") as caught:
        Emulation(faults=f"trace:{trace}").check(4)
    assert "\n" not in str(caught.value)


def test_missing_privileges_are_named_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(privileges, "_capabilities", lambda: 0)
    with pytest.raises(EmulationError, match=r"^--network needs CAP_NET_ADMIN and CAP_SYS_ADMIN \(run as root\)"):
        Emulation(network="2:1e9").check(2)


def test_missing_cgroup_access_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.emulate import CgroupError
    from conveyor.emulate._cgroups import cgroup_roots

    try:
        cgroup_roots()
    except CgroupError as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(privileges.os, "access", lambda path, mode: False)
    with pytest.raises(EmulationError, match=r"^--devices and --faults need write access to /sys/fs/cgroup"):
        Emulation(devices="1").check(2)
