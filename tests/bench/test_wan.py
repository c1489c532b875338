"""conveyor bench wan: every mode trains to the target on an emulated WAN, and the report follows the runs."""

from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.bench.wan import WanBenchConfig, run

pytestmark = pytest.mark.timeout(400)


@needs_root
def test_every_mode_reaches_the_target_and_gaia_sends_less_than_bsp(tmp_path: Path) -> None:
    # Two data centres of one worker joined by 100 Mbit/s: the mlp's all-reduce crosses it at every update.
    cfg = WanBenchConfig(
        models=("mlp",), targets=(0.6,), wan_bytes_per_s=(1.25e7,), sites=2, per_site=1, epochs=3, local_steps=4
    )
    report = run(cfg, plot=str(tmp_path / "wan.png"))
    assert (tmp_path / "wan.png").read_bytes()[:4] == b"\x89PNG"
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == ["lan", "bsp", "gaia", "diloco"]
    for mode, r in rows.items():
        assert r["model"] == "mlp" and r["wan_bytes_per_s"] == 1.25e7, mode
        history = r["history"]
        if r["seconds_to_target"] is not None:
            assert history[r["epochs_to_target"] - 1]["accuracy"] >= 0.6, mode
            assert all(h["accuracy"] < 0.6 for h in history[: r["epochs_to_target"] - 1]), mode
        assert r["final_accuracy"] == history[-1]["accuracy"], mode
    assert rows["lan"]["wan_bytes_per_sample"] == 0 and rows["lan"]["lan_ratio"] == 1.0
    assert rows["bsp"]["seconds_to_target"] is not None  # synchronous: the LAN run's numbers, on a slower network
    # bsp all-reduces the mlp's 26k floats (104 KB) each way per batch of 64: at least 1.6 KB per sample
    assert rows["bsp"]["wan_bytes_per_sample"] > 1600
    assert 0 < rows["gaia"]["wan_bytes_per_sample"] < rows["bsp"]["wan_bytes_per_sample"]
    assert rows["gaia"]["bytes_saved"] == pytest.approx(
        1 - rows["gaia"]["wan_bytes_per_sample"] / rows["bsp"]["wan_bytes_per_sample"]
    )
    assert 0 < rows["gaia"]["sent_fraction"] < 1 and rows["gaia"]["staleness_max"] >= 0
    assert rows["diloco"]["staleness_max"] == 3  # four local steps: read up to three updates late


def test_one_target_per_model_and_known_modes() -> None:
    with pytest.raises(ValueError, match="give one target accuracy per model"):
        WanBenchConfig(models=("mlp", "gpt"), targets=(0.8,))
    with pytest.raises(ValueError, match="unknown modes"):
        WanBenchConfig(modes=("async",))
