"""``conveyor bench markets`` and ``conveyor markets simulate`` on the published traces: the report's shape, its
bounds and the command lines."""

import json
from pathlib import Path

import pytest

from conveyor.bench.markets import AVAILABILITY, MarketsConfig, plot, run
from conveyor.bench.spot import SHARED
from conveyor.cli import main
from conveyor.config import MARKET_POLICIES

KEYS = {"trace_set", "policy", "start_h", "cost_usd", "work", "cost_per_work", "limit_cost_per_work", "finish_h"}


@pytest.fixture
def shared() -> Path:
    needed = (AVAILABILITY, SHARED / "gavel", SHARED / "pipedream-profiles")
    if not all(p.is_dir() for p in needed):
        pytest.skip(f"spot traces, Gavel's table or profiles not found under {SHARED} (only CI and developer machines)")
    return SHARED


def test_a_short_run_reports_every_policy_start_and_goal(shared: Path, tmp_path: Path) -> None:
    cfg = MarketsConfig(trace_sets=("k80-v100-2-zones",), starts=2, discounts=(0.3,))
    report = run(cfg)
    json.dumps(report)
    assert {"config", "results", "summary", "sweep", "calibration", "goals"} <= set(report)
    policies = {r["policy"] for r in report["results"]}
    assert policies == {*MARKET_POLICIES, "portfolio[k80_1]", "portfolio[v100_1]"}
    assert len(report["results"]) == 2 * len(policies)
    for r in report["results"]:
        assert KEYS | {"deadline_h", "deadline_met"} <= set(r)
        assert r["deadline_h"] == pytest.approx(36.0) and r["work"] == pytest.approx(24.0)
        # nothing is cheaper than every second of work on the cheapest spot capacity
        assert r["cost_per_work"] >= r["limit_cost_per_work"] * (1 - 1e-9)
        if r["policy"] == "on-demand":
            assert r["cost_per_work"] == pytest.approx(3.06, rel=0.01) and r["deadline_met"]
    assert {r["billing"] for r in report["sweep"]} == {"per-second", "hourly-2016"}
    markets = [c for c in report["calibration"] if not c["market"].startswith("decile")]
    names = {"us-west-2a_k80_1", "us-west-2b_k80_1", "us-west-2a_v100_1", "us-west-2b_v100_1"}
    assert {"us-west-2a_v100_1", "us-west-2b_v100_1"} <= {c["market"] for c in markets} <= names  # where available
    assert all(0 <= c["brier"] <= 1 and 0 <= c["predicted_rate"] <= 1 for c in report["calibration"])
    goals = report["goals"]
    assert "k80-v100-2-zones/moves_vs_best_static" in goals and "deadline_rate_met" in goals
    plot(report, tmp_path / "markets.png")
    assert (tmp_path / "markets.png").stat().st_size > 0


def test_markets_simulate_writes_its_report_and_plot(shared: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    args = ["markets", "simulate", "--traces", str(AVAILABILITY / "1-node/aws-10-26-2022"), "--instances", "v100_1"]
    assert (
        main([*args, "--starts", "2", "--policies", "on-demand,portfolio", "--json", str(out), "--plot", str(png)]) == 0
    )
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["summary"]] == ["on-demand", "portfolio"]
    assert png.stat().st_size > 0


def test_markets_simulate_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["markets", "simulate", "--traces", str(tmp_path / "none")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["markets", "simulate", "--policies", "cheapest"]) == 2
    assert "unknown policies ['cheapest']" in capsys.readouterr().err


def test_the_real_runs_schedule_follows_the_holding_and_keeps_its_last_count() -> None:
    from conveyor.bench._markets_real import _cost, _schedule  # the real mode's arithmetic, tested alone
    from conveyor.markets import Pricing, Run

    run = Run("portfolio", 0.0, 10.0, 1.0, finish_h=2.5, held=[(0.0, 2, 1), (1.0, 1, 1), (2.5, 0, 0)])
    held = _schedule(run, 1800.0, 8)  # ticks of half an hour
    assert held == [(2, 1)] * 2 + [(1, 1)] * 6  # after the finish, the last holding kept
    # 2.5 h: spot 2 x 1 h + 1 x 1.5 h = 3.5 machine-hours at 0.918, the on-demand machine 2.5 h at 3.06
    assert _cost(held, 1800.0, 2.5, Pricing(0.3)) == pytest.approx(3.5 * 0.918 + 2.5 * 3.06)
