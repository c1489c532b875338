"""conveyor bench costs: all-reduces and activation transfers on the emulated cluster against the cost model."""

from __future__ import annotations

import pytest
from emulation import needs_root

from conveyor.bench.costs import CostsBenchConfig, run
from conveyor.plan import allreduce_s

pytestmark = [needs_root, pytest.mark.timeout(300)]


@pytest.mark.serial  # transfer times against the wall clock
def test_report_sets_each_measurement_beside_its_model() -> None:
    cfg = CostsBenchConfig(
        bandwidths=(1.25e7,),
        replicas=(2,),
        sizes_mb=(1.0,),
        transfer_mb=0.5,
        microbatches=4,
        layouts=("1-1", "2-1"),
        repeats=1,
    )
    report = run(cfg)
    cases = [(r["network"], r["workers"]) for r in report["allreduce"]]
    assert cases == [("2:1.25e+07", 2), ("2:1.25e+08,2:1.25e+07", 4)]
    for row in report["allreduce"]:
        assert row["model_s"] == pytest.approx(allreduce_s(row["bytes"], row["workers"], row["latency_s"], 1.25e7))
        # A shaped link cannot carry more than its rate (its bucket lets 64 KiB through at once): the
        # measurement is a real transfer, not a number that could be anything.
        assert row["measured_s"] > 0.8 * row["model_s"]
    ring, crossing = report["allreduce"]
    assert crossing["measured_s"] > 1.2 * ring["measured_s"]  # 4 workers behind the uplinks: 1.5x the bytes
    one, two = report["transfers"]
    assert (one["stages"], two["stages"]) == ("1-1", "2-1")
    # 4 microbatches of 0.5 MB each way through one receiving link at 12.5 MB/s, in either layout.
    assert one["model_s"] == two["model_s"] == pytest.approx(4 * 0.5e6 / 1.25e7)
    assert all(row["measured_s"] > 0.8 * row["model_s"] for row in report["transfers"])
    (overlap,) = report["overlap"]
    assert overlap["model_s"] == max(overlap["compute_s"], overlap["transfer_s"])
    assert overlap["measured_s"] > 0.8 * overlap["transfer_s"]
    assert report["cases"] == 5 and 0 <= report["within_10_percent"] <= 5


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="replicas >= 2"):
        CostsBenchConfig(replicas=(1,))
