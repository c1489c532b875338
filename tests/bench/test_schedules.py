"""conveyor bench schedules: the measured efficiencies are consistent with the schedules' theory."""

import pytest

from conveyor.bench.schedules import BenchConfig, run

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_report_is_consistent() -> None:
    cfg = BenchConfig(stages=3, microbatches=3, steps=3, forward_ms=4.0, backward_ms=8.0, repeats=2)
    report = run(cfg)
    results = report["results"]
    conveyor = ["gpipe", "flush", "pipedream", "pipedream-vs", "2bw", "dp"]
    assert set(results) == {f"conveyor/{n}" for n in conveyor} | {"torch/gpipe", "torch/1f1b"}
    flush_theory, async_theory = 3 / (3 + 3 - 1), 9 / (9 + 3 - 1)  # one fill per step / per run
    for name, r in results.items():
        kind = name.split("/")[1]
        theory = {"pipedream": async_theory, "pipedream-vs": async_theory, "2bw": async_theory, "dp": 1.0}
        assert r["theory"] == pytest.approx(theory.get(kind, flush_theory)), name
        # Nothing beats the bubble: efficiency cannot exceed the ideal (small slack for clock resolution).
        assert 0.3 < r["efficiency"] <= r["theory"] * 1.01, (name, r)
        assert r["samples_per_s"] == pytest.approx(9 / r["wall_s"])
        assert len(r["wall_s_per_repeat"]) == 2 and min(r["wall_s_per_repeat"]) <= r["wall_s"]
        assert r["speedup_vs_torch_1f1b"] == pytest.approx(r["samples_per_s"] / results["torch/1f1b"]["samples_per_s"])
    for kind in conveyor:
        r = results[f"conveyor/{kind}"]
        assert r["simulated_efficiency"] == pytest.approx(r["theory"]), kind
        assert r["peak_stashed_per_worker"] == r["simulated_peak_stashed_per_worker"], kind
        assert r["peak_weight_versions_per_worker"] == r["schedule_peak_weight_versions_per_worker"], kind
    versions = {k: results[f"conveyor/{k}"]["peak_weight_versions_per_worker"] for k in conveyor}
    assert versions == {
        "gpipe": [1, 1, 1],
        "flush": [1, 1, 1],
        "pipedream": [3, 2, 1],
        "pipedream-vs": [3, 3, 3],
        "2bw": [2, 2, 2],
        "dp": [1, 1, 1],
    }
    assert results["conveyor/flush"]["peak_stashed_per_worker"] == [3, 2, 1]


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BenchConfig(stages=0)
