"""``conveyor bench spot`` on the published traces: the report's shape and its arithmetic."""

import json
from pathlib import Path

import pytest

from conveyor.bench.spot import MEASURED, SHARED, SpotConfig, costs_from_elastic, run

TRACES = SHARED / "spot-traces"
PROFILES = SHARED / "pipedream-profiles"


@pytest.fixture
def shared() -> Path:
    if not (TRACES.is_dir() and PROFILES.is_dir()):
        pytest.skip(f"spot traces or profiles not found under {SHARED} (only CI and developer machines have ../shared)")
    return SHARED


@pytest.mark.parametrize("billing", ["per-second", "hourly-2016"])
def test_a_short_run_on_two_real_traces(shared: Path, billing: str, tmp_path: Path) -> None:
    traces = (str(TRACES / "p3-trace.csv"), str(TRACES / "a100x1-east1b.txt"))
    cfg = SpotConfig(traces=traces, billing=billing, work=1e6, fleet=4, machines=8)
    report = run(cfg, plot_path=str(tmp_path / "spot.png"))
    json.dumps(report)  # JSON-able
    assert (tmp_path / "spot.png").stat().st_size > 0
    assert set(report) == {"config", "prices", "results", "goals"}
    assert [r["policy"] for r in report["results"]] == list(cfg.policies)
    for r in report["results"]:
        assert {"policy", "cost", "seconds", "cost_per_work", "revocations", "additions", "work_lost"} <= set(r)
        assert r["finished"] and r["work"] == pytest.approx(1e6)
        assert r["cost"] > 0 and r["seconds"] > 0
        assert r["cost_per_work"] == pytest.approx(r["cost"] / r["work"] * 1e6)
    on_demand = report["results"][0]
    # all on-demand: fleet x on-demand price x hours (whole hours under hourly billing)
    hours = on_demand["seconds"] / 3600
    price = min(report["prices"].values(), key=lambda p: p["on_demand"] / p["speed"])["on_demand"]
    billed = hours if billing == "per-second" else -(-hours // 1)
    assert on_demand["cost"] == pytest.approx(cfg.fleet * price * billed)
    assert {"vs_on_demand", "vs_checkpoint_restart", "time_met"} <= set(report["goals"])


def test_measured_costs_come_from_a_bench_elastic_report(tmp_path: Path) -> None:
    ev = {"workers": 1, "notice": 0}
    report = {
        "conveyor": {
            "events": [
                {"kind": "revoke", "recovery_s": 3.0, "steps_redone": 2, **ev},
                {"kind": "add", "recovery_s": 1.0, "steps_redone": 0, **ev},
            ]
        },
        "torchrun": {"events": [{"kind": "revoke", "recovery_s": 40.0, "steps_redone": 0, **ev}]},
    }
    path = tmp_path / "elastic.json"
    path.write_text(json.dumps(report))
    costs = costs_from_elastic(path)
    assert costs == {"revocation_s": 3.0, "steps_redone": 2.0, "addition_s": 1.0, "restart_s": 40.0}
    assert set(costs) <= set(MEASURED)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a conveyor bench elastic report"):
        costs_from_elastic(path)


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policies"):
        SpotConfig(policies=("on-demand", "greedy"))
    with pytest.raises(ValueError, match="unknown billing"):
        SpotConfig(billing="monthly")
