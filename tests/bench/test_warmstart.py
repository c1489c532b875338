"""conveyor bench warmstart: speedups and goals from rows, and one small family end to end through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.warmstart import FAMILIES, Family, WarmStartBenchConfig, report
from conveyor.cli import main


def _row(model: str, warm: bool, seconds: float | None, final: float, family: str = "mlp") -> dict:
    return {
        "family": family,
        "model": model,
        "seed": 0,
        "warm_start": warm,
        "parent": "p" if warm else None,
        "seconds_to_target": seconds,
        "epochs_to_target": None if seconds is None else 2,
        "final_accuracy": final,
        "last3_accuracy": final,
        "coverage": 0.8 if warm else 0.0,
        "accuracy": [final],
        "epoch_seconds": [10.0],
    }


def test_report_speedups_medians_and_goals() -> None:
    rows = [
        _row("a", False, 6.0, 0.95),
        _row("a", True, 2.0, 0.96),  # 3x
        _row("b", False, 4.0, 0.95),
        _row("b", True, 4.0, 0.93),  # 1x, two points lower
        _row("c", False, None, 0.80),
        _row("c", True, 5.0, 0.96),
    ]  # scratch never reached: >= 10 / 5 = 2x
    out = report(WarmStartBenchConfig(families=("mlp",)), rows, 0.02)
    speedups = {c["model"]: c["speedup"] for c in out["children"]}
    assert speedups == pytest.approx({"a": 3.0, "b": 1.0, "c": 2.0})
    assert [c["speedup_is_lower_bound"] for c in out["children"]] == [False, False, True]
    assert out["families"]["mlp"]["median_speedup"] == pytest.approx(2.0)
    assert out["families"]["mlp"]["worst_accuracy_change"] == pytest.approx(-0.02)
    assert out["families"]["mlp"]["worst_last3_accuracy_change"] == pytest.approx(-0.02)
    assert out["goals"] == {
        "median_speedup_per_family": True,
        "accuracy_within_one_point": False,
        "match_1000_under_1s": True,
    }
    never = [_row("a", False, 6.0, 0.95), _row("a", True, None, 0.95)]  # a warm start that never reached the target
    assert report(WarmStartBenchConfig(families=("mlp",)), never, 2.0)["goals"] == {
        "median_speedup_per_family": False,
        "accuracy_within_one_point": True,
        "match_1000_under_1s": False,
    }


def test_over_seeds_each_child_is_judged_on_its_medians() -> None:
    """Seed 1's warm start ends 3 points low and seed 2's never reaches the target: the child's accuracy change is
    the median of (+1, -3, 0) points, its speedup that of (3x, 2x, 0)."""
    seeds = [
        [_row("a", False, 6.0, 0.95), _row("a", True, 2.0, 0.96)],
        [_row("a", False, 6.0, 0.95), _row("a", True, 3.0, 0.92)],
        [_row("a", False, 6.0, 0.95), _row("a", True, None, 0.95)],
    ]
    rows = [row | {"seed": seed} for seed, pair in enumerate(seeds, start=4) for row in pair]
    out = report(WarmStartBenchConfig(families=("mlp",), seed=4, seeds=3), rows, 0.02)
    (child,) = out["children"]
    assert [s["speedup"] for s in child["per_seed"]] == pytest.approx([3.0, 2.0, None])
    assert child["speedup"] == pytest.approx(2.0)
    assert child["accuracy_change"] == pytest.approx(0.0) and child["last3_accuracy_change"] == pytest.approx(0.0)
    assert out["families"]["mlp"]["worst_accuracy_change"] == pytest.approx(0.0)
    assert out["goals"]["accuracy_within_one_point"] and out["goals"]["median_speedup_per_family"]
    with pytest.raises(ValueError, match="--seeds must be at least 1, got 0"):
        WarmStartBenchConfig(seeds=0)


def test_bad_families_and_a_used_folder_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "warmstart", "--families", "mlp,lenet"]) == 2
    assert "unknown families ['lenet']: choose from mlp, vgg, resnet, gpt" in capsys.readouterr().err
    for given in (",", "mlp,mlp"):
        assert main(["bench", "warmstart", "--families", given]) == 2
        assert "give each family once, at least one" in capsys.readouterr().err
    (tmp_path / "store").mkdir()  # an earlier run's models would be parents: refused
    assert main(["bench", "warmstart", "--families", "mlp", "--keep", str(tmp_path)]) == 2
    assert "exists: give --keep a new folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_small_family_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = Family("mlp", parents=((16, 1),), children=((32, 1),), target=0.8, epochs=3, parent_epochs=6, lr=0.05)
    monkeypatch.setitem(FAMILIES, "tiny", tiny)
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    files = ["--keep", str(tmp_path / "k"), "--json", str(out), "--plot", str(png)]
    assert main(["bench", "warmstart", "--families", "tiny", *files]) == 0
    result = json.loads(out.read_text())
    scratch, warm = result["results"]
    assert {k for k in scratch} >= {
        "family",
        "model",
        "warm_start",
        "seconds_to_target",
        "epochs_to_target",
        "final_accuracy",
        "coverage",
    }
    assert (scratch["warm_start"], warm["warm_start"]) == (False, True) and scratch["coverage"] == 0.0
    assert warm["parent"].startswith("mlp-") and warm["parent_model"] == "mlp w16 d1"
    assert warm["coverage"] == 1.0  # widened 16 -> 32: every weight set
    run = json.loads((tmp_path / "k" / "tiny-w32-d1-warm" / "summary.json").read_text())
    assert warm["prepare_s"] == run["warm_start"]["seconds"] > 0  # the launcher's work is charged
    reached = warm["epochs_to_target"] - 1
    assert warm["seconds_to_target"] == pytest.approx(run["epoch_seconds"][reached] + run["warm_start"]["seconds"])
    # Net2Net widening starts the child where the 6-epoch parent ended; scratch starts from its random weights
    assert warm["accuracy"][0] > scratch["accuracy"][0]
    assert 0 < result["match_1000_s"] < 5
    assert png.stat().st_size > 1000
    stored = json.loads((tmp_path / "k" / "tiny-w16-d1-stored" / "summary.json").read_text())
    assert stored["registered"] == warm["parent"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_seed_trains_into_a_store_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = Family("mlp", parents=((16, 1),), children=((32, 1),), target=0.8, epochs=2, parent_epochs=2, lr=0.05)
    monkeypatch.setitem(FAMILIES, "tiny", tiny)
    out = tmp_path / "w.json"
    assert (
        main(["bench", "warmstart", "--families", "tiny", "--seeds", "2", "--keep", str(tmp_path), "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert [(r["seed"], r["warm_start"]) for r in result["results"]] == [(0, False), (0, True), (1, False), (1, True)]
    for seed, (_, warm) in enumerate(zip(result["results"][::2], result["results"][1::2], strict=True)):
        # each seed's warm start took its parent from its own store, the parent its seed trained
        stored = json.loads((tmp_path / f"seed-{seed}" / "tiny-w16-d1-stored" / "summary.json").read_text())
        assert warm["parent"] == stored["registered"]
    (child,) = result["children"]
    assert [s["accuracy_change"] for s in child["per_seed"]] == [
        warm["final_accuracy"] - scratch["final_accuracy"]
        for scratch, warm in zip(result["results"][::2], result["results"][1::2], strict=True)
    ]
