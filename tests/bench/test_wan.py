"""conveyor bench wan: every mode trains to the target on an emulated WAN, and the report follows the runs."""

from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.bench.wan import WanBenchConfig, add_ratios, over_seeds, run
from conveyor.errors import InputError

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
    pilot = rows["gaia"]["estimate_pilot"]  # --wan-estimate auto: tried before training, on workers 0 and 1
    assert pilot["sites"] == 2 and pilot["share"] == cfg.batch_size // 2 and pilot["seconds"] > 0
    assert 0 < pilot["score"] < 3 and 0 < pilot["scaled_score"] < 3  # the mlp's 10 digits: ln 10 = 2.3 at the start
    if rows["gaia"]["seconds_to_target"] is not None:
        assert rows["gaia"]["lan_ratio_with_pilot"] == pytest.approx(
            (rows["gaia"]["seconds_to_target"] + pilot["seconds"]) / rows["lan"]["seconds_to_target"]
        )
    assert rows["bsp"]["estimate_pilot"] is None and rows["diloco"]["estimate_pilot"] is None
    assert rows["diloco"]["staleness_max"] == 3  # four local steps: read up to three updates late
    # Planned with the all-reduce inside each data centre (a LAN of one worker: none), where bsp's crosses the WAN:
    # a ring of two sends the mlp's 104 KB each way, 8.3 ms a batch at 100 Mbit/s, which bsp's predicted batch
    # time holds and gaia's does not (half of it, for what the simulator overlaps with the backward).
    batch_s = {mode: cfg.batch_size / rows[mode]["predicted_samples_per_s"] for mode in ("gaia", "bsp")}
    assert batch_s["bsp"] - batch_s["gaia"] > 0.5 * 104e3 / 1.25e7


def test_one_target_per_model_and_known_modes() -> None:
    with pytest.raises(ValueError, match="give one target accuracy per model"):
        WanBenchConfig(models=("mlp", "gpt"), targets=(0.8,))
    with pytest.raises(ValueError, match="unknown modes"):
        WanBenchConfig(modes=("async",))


def test_an_unknown_model_fails_before_any_run() -> None:
    with pytest.raises(InputError, match="nope"):  # the second model, before the first trains
        run(WanBenchConfig(models=("mlp", "nope"), targets=(0.5, 0.5)))


def test_each_seed_is_set_against_its_own_lan_run_and_the_seeds_summed_up() -> None:
    rows = []
    for seed, (lan, gaia) in enumerate([(10.0, 15.0), (20.0, None), (10.0, 12.0)]):
        for mode, seconds in (("lan", lan), ("gaia", gaia)):
            row = {"model": "m", "wan_bytes_per_s": 1.0, "mode": mode, "seed": seed, "seconds_to_target": seconds}
            rows.append(row | {"wan_bytes_per_sample": 0.0, "final_accuracy": 0.9})
    add_ratios(rows)
    assert [r["lan_ratio"] for r in rows if r["mode"] == "gaia"] == [1.5, None, 1.2]
    assert [r["lan_ratio_with_pilot"] for r in rows if r["mode"] == "gaia"] == [1.5, None, 1.2]  # no pilot
    rows[1]["estimate_pilot"] = {"seconds": 2.0}  # seed 0's gaia run tried the estimate for 2 s before training
    add_ratios(rows)
    assert rows[1]["lan_ratio"] == 1.5 and rows[1]["lan_ratio_with_pilot"] == pytest.approx(1.7)
    gaia = next(case for case in over_seeds(rows) if case["mode"] == "gaia")
    assert gaia["seeds"] == 3 and gaia["reached"] == 2
    assert (gaia["lan_ratio_min"], gaia["lan_ratio_median"], gaia["lan_ratio_max"]) == (1.2, pytest.approx(1.35), 1.5)
    with pytest.raises(ValueError, match="seeds must be at least 1, got 0"):
        WanBenchConfig(seeds=0)
