"""conveyor bench convergence: epochs to target per strategy and seed, medians, factors and the plot."""

from pathlib import Path

import pytest

from conveyor.bench.convergence import ConvergenceConfig, epochs_to, faster_rate, run, summarise

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_report_of_real_runs(tmp_path: Path) -> None:
    cfg = ConvergenceConfig(models=("mlp",), strategies=("dp", "2bw", "2bw/damped"), seeds=2, workers=2)
    report = run(cfg, plot=str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    target, cap = report["targets"]["mlp"]
    per = report["results"]["mlp"]
    for r in per.values():
        assert len(r["runs"]) == 2
        for run_ in r["runs"]:  # epochs to target agrees with the run's own accuracy curve
            assert run_["epochs_to_target"] == epochs_to(run_["accuracy"], target)
            assert len(run_["accuracy"]) <= cap
        assert r["median_epochs"] == summarise([x["epochs_to_target"] for x in r["runs"]], cap)
        assert r["factor"] == r["median_epochs"] / per["dp"]["median_epochs"]
    assert per["2bw"]["goal_met"] == (per["2bw"]["factor"] <= report["goal"]) and per["dp"]["goal_met"] is None
    assert per["2bw/damped"]["goal_met"] == (per["2bw/damped"]["factor"] <= report["goal"])
    assert report["epoch_factors"] == {"mlp": {s: per[s]["factor"] for s in ("dp", "2bw", "2bw/damped")}}
    seeds = {s: [r["epochs_to_target"] for r in per[s]["runs"]] for s in per}
    damped = faster_rate(seeds["2bw"], seeds["2bw/damped"], cap) == "damped"
    assert report["stale_rates"] == ({"mlp": {"2bw": "damped"}} if damped else {})
    assert per["2bw"]["runs"] != per["2bw/damped"]["runs"]  # the two rates train differently
    assert per["dp"]["reached"]  # data parallelism gets there within the cap


def test_summaries() -> None:
    assert summarise([3, None, 5], cap=10) == 5.0
    assert summarise([None, None, 4], cap=10) == 11.0  # most seeds missed: the median is past the cap


def test_the_faster_rate_is_the_fewer_median_epochs_then_the_better_worst_seed() -> None:
    assert faster_rate([3, 4, 3], [2, 3, 3], cap=12) == "damped"  # same median, a better worst seed
    assert faster_rate([3, 3, 3], [3, 3, 3], cap=12) == "sample"  # a tie keeps the rate per sample
    assert faster_rate([3, None, 3], [3, 4, 3], cap=12) == "damped"  # a seed that missed counts as the cap + 1
    assert faster_rate([2, 2, 12], [3, 3, None], cap=12) == "sample"


def test_bad_configs() -> None:
    with pytest.raises(ValueError, match="unknown models"):
        ConvergenceConfig(models=("alexnet",))
    with pytest.raises(ValueError, match="must include dp"):
        ConvergenceConfig(strategies=("2bw",))
