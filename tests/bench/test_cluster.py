"""conveyor cluster and bench cluster: the report's goals, the plot, simulations from the command line, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.cluster import ClusterBenchConfig, parse_cluster, plot, report, sustained
from conveyor.cli import main
from conveyor.cluster import Allocation, Problem, TraceJob, write_trace

SHARED = Path(__file__).resolve().parents[3] / "shared" / "gavel"


def _rows() -> list[dict]:
    jcts = {"max_min_fairness": [40.0, 50.0, 200.0], "max_min_fairness_perf": [20.0, 30.0, 60.0]}
    return [
        {"policy": p, "jobs_per_hour": r, "average_jct_s": j * 3600, "utilization": 0.5}
        for p, js in jcts.items()
        for r, j in zip((1.0, 2.0, 3.0), js, strict=True)
    ]


def test_report_judges_the_goals_from_the_rows() -> None:
    cfg = ClusterBenchConfig(rates=(1.0, 2.0, 3.0))
    fidelity = {"real_jct_s": 100.0, "simulated_jct_s": 108.0}
    out = report(cfg, _rows(), {"max_min_fairness_perf": {"2048": 0.2}}, fidelity)
    goals = out["goals"]
    assert goals["jct_ratio_at_highest_finite_load"] == pytest.approx(200 / 60)
    assert goals["jct_ratio_max"] == pytest.approx(200 / 60) and goals["aware_better_at_high_load"]
    # 3 x the aware policy's 20 h at the lowest rate: aware sustains 3 jobs/h (60 h), agnostic 2 (50 h).
    assert out["sustained_jobs_per_hour"]["3"] == {"max_min_fairness": 2.0, "max_min_fairness_perf": 3.0}
    assert goals["sustained_load_ratio"] == pytest.approx(1.5)
    assert goals["solve_2048_under_1s"] and goals["fidelity_within_10pct"]
    assert goals["fidelity_error"] == pytest.approx(0.08)


def test_sustained_and_plot(tmp_path: Path) -> None:
    assert sustained(_rows(), 45 * 3600) == {"max_min_fairness": 1.0, "max_min_fairness_perf": 2.0}
    plot(_rows(), tmp_path / "jct.png")
    assert (tmp_path / "jct.png").stat().st_size > 1000


def test_parse_cluster() -> None:
    assert parse_cluster("v100=36,k80=2").counts == {"v100": 36, "k80": 2}
    with pytest.raises(ValueError, match="TYPE=COUNT"):
        parse_cluster("v100:36")


@pytest.fixture
def gavel_table() -> Path:
    if not (SHARED / "simulation_throughputs.json").exists():
        pytest.skip(f"Gavel's throughputs not found at {SHARED} (only CI and developer machines have ../shared)")
    return SHARED / "simulation_throughputs.json"


def test_solve_times_on_the_study_cluster_and_on_gavels_sweep_cluster(
    gavel_table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import conveyor.bench.cluster as bench

    capacities: list[list[int]] = []
    real_allocate = bench.allocate

    def spy(policy: str, problem: Problem) -> Allocation:
        capacities.append([int(c) for c in problem.capacity])
        return real_allocate(policy, problem)

    monkeypatch.setattr(bench, "allocate", spy)
    cfg = ClusterBenchConfig(solve_sizes=(8, 16), throughputs=str(gavel_table))
    fixed = bench.solve_times(cfg, ("max_min_fairness_perf",), repeats=1)
    assert set(fixed["max_min_fairness_perf"]) == {"8", "16"} and capacities == [[36, 36, 36]] * 2
    capacities.clear()
    sweep = bench.solve_times(cfg, ("max_min_fairness_perf",), repeats=1, sweep_cluster=True)
    assert capacities == [[2, 2, 2], [4, 4, 4]]  # n/4 of each type, as Gavel's sweep_policy_runtimes.py
    assert all(0 < t < 10 for t in sweep["max_min_fairness_perf"].values())
    assert report(cfg, [], fixed, None, sweep)["solve_s_sweep_cluster"] == sweep


def test_simulate_writes_json_a_trace_and_a_plot(tmp_path: Path, gavel_table: Path) -> None:
    out = tmp_path / "out.json"
    argv = [
        "cluster",
        "simulate",
        "--jobs",
        "12",
        "--jobs-per-hour",
        "2,4",
        "--cluster",
        "v100=4,p100=4,k80=4",
        "--policy",
        "max_min_fairness,max_min_fairness_perf",
        "--json",
        str(out),
        "--plot",
        str(tmp_path / "p.png"),
        "--write-trace",
        str(tmp_path / "t.trace"),
        "--throughputs",
        str(gavel_table),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["average_jct_s"] > 0 and 0 < r["utilization"] <= 1 for r in rows)
    assert (tmp_path / "t-2.trace").exists() and (tmp_path / "t-4.trace").exists() and (tmp_path / "p.png").exists()
    # the written trace replays to the same results
    again = tmp_path / "again.json"
    argv = [
        "cluster",
        "simulate",
        "--trace",
        str(tmp_path / "t-2.trace"),
        "--cluster",
        "v100=4,p100=4,k80=4",
        "--policy",
        "max_min_fairness_perf",
        "--json",
        str(again),
        "--throughputs",
        str(gavel_table),
    ]
    assert main(argv) == 0
    assert json.loads(again.read_text())["rows"][0]["average_jct_s"] == pytest.approx(rows[1]["average_jct_s"])


def test_bad_input_is_one_line(tmp_path: Path, gavel_table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unknown = tmp_path / "unknown.trace"
    write_trace([TraceJob("NoSuchModel", total_steps=10, scale_factor=1, arrival_s=0.0)], unknown)
    big = tmp_path / "big.trace"
    write_trace([TraceJob("ResNet-50 (batch size 64)", total_steps=10, scale_factor=8, arrival_s=0.0)], big)
    cases = [
        (["--trace", str(unknown)], "NoSuchModel"),
        (["--trace", str(big), "--cluster", "v100=4,p100=4,k80=4"], "needs 8 devices"),
        (["--jobs", "3", "--policy", "nope"], "unknown policy"),
        (["--jobs", "3", "--window", "5:2"], "--window"),
    ]
    for extra, words in cases:
        assert main(["cluster", "simulate", "--throughputs", str(gavel_table), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


def test_an_infeasible_slo_is_reported_then_solved_without_it(
    tmp_path: Path, gavel_table: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two long jobs due almost at once on one device: both SLOs cannot hold.
    trace = tmp_path / "slo.trace"
    jobs = [TraceJob("ResNet-18 (batch size 16)", total_steps=50_000, scale_factor=1, arrival_s=0.0, slo=1.05)] * 2
    write_trace(jobs, trace)
    argv = [
        "cluster",
        "simulate",
        "--trace",
        str(trace),
        "--cluster",
        "v100=1",
        "--policy",
        "max_throughput_per_dollar",
        "--throughputs",
        str(gavel_table),
        "--json",
        str(tmp_path / "o.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "SLO" in out
    row = json.loads((tmp_path / "o.json").read_text())["rows"][0]
    assert row["slo_violations"] >= 1 and row["average_jct_s"] < float("inf")
