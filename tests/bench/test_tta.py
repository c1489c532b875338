"""conveyor bench tta: every strategy trains to the target, and the report and plot agree with the runs."""

from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.bench.tta import TTAConfig, _over_seeds, run

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_time_to_accuracy_report(tmp_path: Path) -> None:
    cfg = TTAConfig(workers=2, target=0.6, epochs=6, strategies=("dp", "ddp", "pipedream"))  # (2bw: test_train)
    report = run(cfg, plot=str(tmp_path / "tta.png"))
    assert (tmp_path / "tta.png").read_bytes()[:4] == b"\x89PNG"
    results = report["results"]
    assert list(results) == ["dp", "ddp", "pipedream"]
    assert results["dp"]["layout"] == [2] and results["ddp"]["layout"] == [2]
    for name, r in results.items():
        history = r["history"]
        assert r["seconds_to_target"] is not None, name  # the asynchronous schedule gets there too
        reached = history[r["epochs_to_target"] - 1]
        assert reached["accuracy"] >= 0.6 and reached["seconds"] == r["seconds_to_target"]
        assert all(h["accuracy"] < 0.6 for h in history[: r["epochs_to_target"] - 1])
        assert r["samples_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["measured_speedup"] == pytest.approx(results["dp"]["seconds_to_target"] / r["seconds_to_target"])
        assert r["bytes_between_servers_per_sample"] is None and r["comm_fraction"] is None  # no network here
    assert results["dp"]["predicted_speedup"] == 1.0 and results["ddp"]["predicted_speedup"] is None
    assert report["goals"]["speedup_vs_dp"] == results["pipedream"]["measured_speedup"]
    (seed,) = report["seeds"]  # one seed: the results above
    assert seed["seed"] == 0 and seed["epochs_to_target"] == {k: r["epochs_to_target"] for k, r in results.items()}
    assert report["over_seeds"]["strategies"]["dp"]["median_epochs_to_target"] == results["dp"]["epochs_to_target"]


def _seed(pd_epochs: int | None, dp_epochs: int, speedup: float | None) -> dict:
    pd = {"seconds_to_target": None if pd_epochs is None else 1.0, "epochs_to_target": pd_epochs}
    dp = {"seconds_to_target": 5.0, "epochs_to_target": dp_epochs}
    return {"results": {"dp": {**dp, "measured_speedup": 1.0}, "pipedream": {**pd, "measured_speedup": speedup}}}


def test_over_seeds_every_seed_must_meet_the_goals() -> None:
    """PipeDream within 1.25x of data parallelism's epochs and 5x sooner, in every seed (medians over those that
    reached the target)."""
    good = [_seed(3, 3, 6.0), _seed(4, 4, 5.5), _seed(5, 4, 5.1)]  # 1.25x the epochs at most: met
    over = _over_seeds(good, ("dp", "pipedream"))
    assert over["met"] and over["pipedream_epochs_over_dp"] == [1.0, 1.0, 1.25]
    medians = {"reached": 3, "median_seconds_to_target": 1.0, "median_epochs_to_target": 4}
    assert over["strategies"]["pipedream"] == medians
    assert not _over_seeds([*good, _seed(9, 3, 2.0)], ("dp", "pipedream"))["met"]  # seed 2 of the issue: 3x the epochs
    missed = _over_seeds([*good, _seed(None, 3, None)], ("dp", "pipedream"))  # one seed never got there
    assert not missed["met"] and missed["strategies"]["pipedream"]["reached"] == 3
    with pytest.raises(ValueError, match="seeds must be at least 1"):
        TTAConfig(seeds=0)


@needs_root
def test_on_an_emulated_network_the_links_are_counted(tmp_path: Path) -> None:
    """Two servers of one worker: data parallelism all-reduces across the slow link, PipeDream sends activations."""
    cfg = TTAConfig(
        workers=2, target=0.6, epochs=4, strategies=("dp", "pipedream"), network="1:1.25e9,2:1.25e8", local_epochs=1
    )
    results = run(cfg)["results"]
    for name, r in results.items():
        assert r["bytes_between_servers_per_sample"] > 0, name
        assert r["local_samples_per_s"] > 0 and r["comm_fraction"] < 1, name
    # (DDP's bytes go through the same network counters as dp's; it runs in the test above.) The mlp's
    # all-reduce moves its weights (26k floats, about 104 KB) both ways per batch of 64, at least
    # 2 x 104 KB / 64 = 3.3 KB per sample; PipeDream sends a 128-float activation and its gradient per sample.
    assert results["dp"]["bytes_between_servers_per_sample"] > 3000


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="unknown strategies"):
        TTAConfig(strategies=("zero-bubble",))
