"""conveyor bench energy: goals judged from rows, the plot, one workload end to end, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.energy import WORKLOADS, EnergyBenchConfig, plot, report, run_workload
from conveyor.cli import main
from conveyor.energy import load_traces

SHARED = Path(__file__).resolve().parents[3] / "shared" / "zeus-traces"


def _rows() -> list[dict]:
    energy = {"default": 100.0, "conveyor": 60.0, "zeus": 62.0, "oracle": 55.0}
    cost = {"default": 200.0, "conveyor": 120.0, "zeus": 110.0, "oracle": 100.0}
    return [
        {
            "workload": "w/net",
            "gpu": "v100",
            "policy": p,
            "energy_j": energy[p],
            "time_s": 1.0,
            "cost": cost[p],
            "regret": cost[p] - 100.0,
            "default_batch_size": 32,
        }
        for p in energy
    ]


def test_report_judges_the_goals() -> None:
    out = report(EnergyBenchConfig(traces="x"), _rows())
    [check] = out["checks"]
    assert check["energy_reduction"] == pytest.approx(0.4) and check["within_paper_range"]  # 15.3% <= 40% <= 75.8%
    assert check["zeus_energy_reduction"] == pytest.approx(0.38)
    assert check["cost_vs_zeus"] == pytest.approx(120 / 110 - 1) and check["cost_within_10pct_of_zeus"]
    assert out["goals"] == {
        "energy_reduction_in_paper_range_everywhere": True,
        "cost_within_10pct_of_zeus_everywhere": True,
    }
    far = [dict(r, cost=140.0) if r["policy"] == "conveyor" else r for r in _rows()]
    assert not report(EnergyBenchConfig(traces="x"), far)["goals"]["cost_within_10pct_of_zeus_everywhere"]


def test_plot(tmp_path: Path) -> None:
    plot(_rows(), tmp_path / "e.png")
    assert (tmp_path / "e.png").stat().st_size > 1000


@pytest.fixture
def traces() -> Path:
    if not (SHARED / "summary_train.csv").exists():
        pytest.skip(f"Zeus' traces not found at {SHARED} (only CI and developer machines have ../shared)")
    return SHARED


def test_one_workload_every_policy(traces: Path) -> None:
    cfg = EnergyBenchConfig(traces=str(traces), recurrences=20, seeds=(1,))
    squad = next(w for w in WORKLOADS if w.dataset == "squad")
    rows = {r["policy"]: r for r in run_workload(load_traces(traces, [squad], "p100")[0], cfg)}
    assert set(rows) == {"default", "conveyor", "oracle", "zeus"}
    assert rows["default"]["default_batch_size"] == 24  # b0 32 capped at P100's largest size, as Zeus' artifact
    assert rows["conveyor"]["regret"] == pytest.approx(rows["conveyor"]["cost"] - rows["oracle"]["cost"])
    assert rows["oracle"]["cost"] <= rows["default"]["cost"] and rows["conveyor"]["cost"] < rows["default"]["cost"]


def test_command_line(traces: Path, tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "bench",
                "energy",
                "--traces",
                str(traces),
                "--gpus",
                "v100",
                "--recurrences",
                "10",
                "--seeds",
                "1",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "e.png"),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert {r["policy"] for r in data["results"]} == {"default", "conveyor", "oracle", "zeus"}
    assert {"workload", "gpu", "policy", "energy_j", "time_s", "cost", "regret"} <= set(data["results"][0])
    assert len(data["checks"]) == len(WORKLOADS)


def test_missing_traces_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "energy", "--traces", str(tmp_path), "--gpus", "v100"]) == 2
    assert "no Zeus trace at" in capsys.readouterr().err
