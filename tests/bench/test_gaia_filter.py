"""conveyor bench gaia-filter: both ways timed on the same updates, and the same entries selected."""

import pytest

from conveyor.bench.gaia_filter import FilterBenchConfig, run


def test_report_times_both_ways_and_checks_they_agree() -> None:
    report = run(FilterBenchConfig(weights=20_000, updates=3, warmup=1))
    assert report["same_selection"] is True
    assert report["fused_s_per_update"] > 0 and report["packed_s_per_update"] > 0
    assert report["speedup"] == pytest.approx(report["packed_s_per_update"] / report["fused_s_per_update"])
    assert 0 < report["sent_fraction_last_update"] < 1  # some entries held back, some sent
    with pytest.raises(ValueError, match="at least 1"):
        FilterBenchConfig(updates=0)
