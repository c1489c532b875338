"""conveyor bench schedules: the measured efficiencies are consistent with the schedules' theory."""

import pytest

from conveyor.bench.schedules import BenchConfig, run

pytestmark = pytest.mark.timeout(120)


def test_report_is_consistent() -> None:
    cfg = BenchConfig(stages=3, microbatches=4, steps=3, forward_ms=4.0, backward_ms=8.0, repeats=2)
    report = run(cfg)
    theory = 4 / (4 + 3 - 1)
    for name, r in report["results"].items():
        assert r["theory"] == pytest.approx(theory)
        # Nothing beats the bubble: efficiency cannot exceed the ideal (small slack for clock resolution).
        assert 0.3 < r["efficiency"] <= theory * 1.01, (name, r)
        assert r["samples_per_s"] == pytest.approx(3 * 4 / r["wall_s"])
        assert len(r["wall_s_per_repeat"]) == 2 and min(r["wall_s_per_repeat"]) <= r["wall_s"]
    for name in ("conveyor/gpipe", "conveyor/flush"):
        r = report["results"][name]
        assert r["simulated_efficiency"] == pytest.approx(theory)
        assert r["peak_stashed_per_stage"] == r["simulated_peak_stashed_per_stage"]
    assert report["results"]["conveyor/flush"]["peak_stashed_per_stage"] == [3, 2, 1]


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BenchConfig(stages=0)
