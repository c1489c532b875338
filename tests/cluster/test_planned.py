"""The planner's throughputs per device type."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cluster import planned_throughputs
from conveyor.plan import Profile

PROFILES = Path(__file__).resolve().parents[3] / "shared" / "pipedream-profiles"


PROFILE = Profile.chain(
    "toy", forward_s=[0.01] * 6, backward_s=[0.02] * 6, output_bytes=[4_000_000] * 6, param_bytes=[40_000_000] * 6
)


def test_planned_throughputs_are_faster_on_faster_devices_and_more_devices() -> None:
    speeds = {"v100": 1.0, "p100": 0.6, "k80": 0.25}
    rates = planned_throughputs(PROFILE, speeds, (1, 2, 4, 8), bandwidth=1.25e9)
    assert set(rates) == {(s, t) for s in (1, 2, 4, 8) for t in speeds}
    assert rates[(1, "v100")] == pytest.approx(1 / 0.18)  # one device: all the compute, no communication
    for s in (1, 2, 4, 8):
        assert rates[(s, "v100")] > rates[(s, "p100")] > rates[(s, "k80")] > 0
    for t in speeds:
        assert [rates[(s, t)] for s in (1, 2, 4, 8)] == sorted(rates[(s, t)] for s in (1, 2, 4, 8))
    slow = planned_throughputs(PROFILE, {"v100": 1.0}, (1, 8), bandwidth=1e6)  # links too slow to help
    assert slow[(8, "v100")] == slow[(1, "v100")]


def test_planned_throughputs_options() -> None:
    small = planned_throughputs(PROFILE, {"k80": 0.25, "v100": 1.0}, (1, 2), memory={"k80": 1e8})
    assert small[(1, "k80")] == 0.0 and small[(1, "v100")] > 0  # the model does not fit one k80's memory
    with pytest.raises(ValueError, match=r"device type 'k80' has relative speed 0: give a finite number > 0"):
        planned_throughputs(PROFILE, {"k80": 0})
    with pytest.raises(ValueError, match=r"scale factors \[0\] must be at least 1"):
        planned_throughputs(PROFILE, {"k80": 1.0}, (0,))
    with pytest.raises(ValueError, match="bandwidth 0 must be a finite number of bytes/s > 0"):
        planned_throughputs(PROFILE, {"k80": 1.0}, bandwidth=0)
    with pytest.raises(ValueError, match="unknown cost model 'fast'"):
        planned_throughputs(PROFILE, {"k80": 1.0}, cost_model="fast")
    measured = Profile.chain(
        "b32", forward_s=[0.01], backward_s=[0.02], output_bytes=[8], param_bytes=[8], batch_size=32
    )
    with pytest.raises(ValueError, match=r"no measurements at batch size 64 \(it has \[32\]\)"):
        planned_throughputs(measured, {"v100": 1.0}, (1,), batch_size=64)
    assert planned_throughputs(measured, {"v100": 1.0}, (1,), batch_size=32)[(1, "v100")] == pytest.approx(1 / 0.03)


def test_planned_throughputs_of_a_pipedream_profile() -> None:
    if not (PROFILES / "resnet18" / "graph.txt").is_file():
        pytest.skip(f"PipeDream profiles not found at {PROFILES} (only CI and developer machines have ../shared)")
    rates = planned_throughputs(Profile.load(PROFILES / "resnet18"), {"v100": 1.0, "k80": 0.25}, (1, 4))
    assert rates[(4, "v100")] > rates[(1, "v100")] > rates[(1, "k80")] > 0
