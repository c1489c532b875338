"""conveyor bench plan-vs-run: planned pipelines run, and their throughput is bounded by the prediction."""

import pytest

from conveyor.bench.plan_vs_run import PlanVsRunConfig, run

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_report_compares_measured_and_predicted_throughput() -> None:
    report = run(PlanVsRunConfig(minibatches=15, repeats=1, up_to=4, candidates=2))
    results = {r["case"]: r for r in report["results"] + report["candidates"]}
    assert [r["case"] for r in report["candidates"]] == ["candidate 1", "candidate 2"]
    assert report["chosen"]["config"] == report["candidates"][0]["config"] == "2-1-1"  # the steady state's choice too
    best = max(r["measured_samples_per_s"] for r in report["candidates"])
    assert report["chosen"]["shortfall"] == pytest.approx(1 - results["candidate 1"]["measured_samples_per_s"] / best)
    assert results["straight, 4 workers"]["config"] == "1-1-1-1"
    # The heavy first layer (few weights) on two replicas, the rest in two stages of the same 18 ms.
    assert results["planned, 4 workers"]["config"] == "2-1-1"
    for r in results.values():
        # Sleeping stages cannot run faster than the simulation of the same action lists.
        assert 0.5 * r["simulated_samples_per_s"] < r["measured_samples_per_s"] <= 1.02 * r["simulated_samples_per_s"]
        assert r["error_vs_simulated"] == pytest.approx(r["measured_samples_per_s"] / r["simulated_samples_per_s"] - 1)
        # The planner's steady state leaves out the fill and drain the simulation includes.
        assert r["simulated_samples_per_s"] <= r["planner_samples_per_s"]
    assert (
        results["planned, 4 workers"]["measured_samples_per_s"]
        > results["straight, 4 workers"]["measured_samples_per_s"]
    )


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PlanVsRunConfig(minibatches=0)
