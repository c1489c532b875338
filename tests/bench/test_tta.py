"""conveyor bench tta: every strategy trains to the target, and the report and plot agree with the runs."""

from pathlib import Path

import pytest

from conveyor.bench.tta import TTAConfig, run

pytestmark = pytest.mark.timeout(240)


def test_time_to_accuracy_report(tmp_path: Path) -> None:
    cfg = TTAConfig(workers=2, target=0.8, epochs=8, strategies=("dp", "pipedream", "2bw"))
    report = run(cfg, plot=str(tmp_path / "tta.png"))
    assert (tmp_path / "tta.png").read_bytes()[:4] == b"\x89PNG"
    results = {r["strategy"]: r for r in report["results"]}
    assert results.keys() == {"dp", "pipedream", "2bw"}
    assert results["dp"]["layout"]["replicas"] == [2] and results["pipedream"]["layout"]["replicas"] == [1, 1]
    for name, r in results.items():
        history = r["history"]
        assert r["seconds_to_target"] is not None, name  # the asynchronous schedules get there too
        reached = history[r["epochs_to_target"] - 1]
        assert reached["accuracy"] >= 0.8 and reached["seconds"] == r["seconds_to_target"]
        assert all(h["accuracy"] < 0.8 for h in history[: r["epochs_to_target"] - 1])
        assert len(r["peak_rss_bytes_per_worker"]) == 2 and r["samples_per_s"] > 0


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="unknown strategies"):
        TTAConfig(strategies=("zero-bubble",))
