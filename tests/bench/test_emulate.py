"""conveyor bench emulate: links at each rate, quotas and set-up times against their spec (root only)."""

from __future__ import annotations

import pytest
from emulation import needs_root

from conveyor.bench.emulate import RATES, EmulateBenchConfig, run
from conveyor.emulate import Emulation, check_cluster

pytestmark = [needs_root, pytest.mark.timeout(300)]


@pytest.mark.serial  # rates against the wall clock
def test_report_has_every_rate_quota_and_cluster_size() -> None:
    report = run(EmulateBenchConfig(devices="1,0.5", seconds_per_link=0.5, repeats=1))
    rates = [link["rate"] for link in report["links"]]
    assert rates == [rate for rate in [*RATES, "unshaped"] for _ in range(2)]  # both directions of each
    for link in report["links"]:
        if link["rate"] in ("10 Mbit/s", "100 Mbit/s"):  # far below any machine's ceiling
            assert link["error"] == pytest.approx(link["measured_bytes_per_s"] / link["spec_bytes_per_s"] - 1)
            assert abs(link["error"]) < 0.10
    assert report["ceiling_bytes_per_s"] > 1.25e8
    assert [row["spec_cores"] for row in report["devices"]] == [1, 0.5]
    assert [row["workers"] for row in report["setup"]] == [4, 16]
    assert all(row["setup_s"] > 0 and row["teardown_s"] >= 0 for row in report["setup"])
    links_only = check_cluster(Emulation(network="2:1.25e7"), 2, 0.2, speeds=False)  # as the rates are measured
    assert links_only["devices"] == [] and [(link["from"], link["to"]) for link in links_only["links"]] == [
        (0, 1),
        (1, 0),
    ]
