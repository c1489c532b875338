"""The table of epochs per schedule: read from a convergence report, looked up with cautious fallbacks."""

import json
from pathlib import Path

import pytest

from conveyor.bench.convergence import ASYNC, TARGETS, faster_rate
from conveyor.plan._epochs import SHIPPED
from conveyor.plan.parts import EpochFactors
from conveyor.schedule import KINDS


def test_the_shipped_table_covers_every_schedule_on_every_zoo_model() -> None:
    factors = EpochFactors.load()
    assert "conveyor bench convergence" in factors.source
    for model in ("mlp", "vgg", "resnet", "gpt", "vgg16"):
        assert factors.table[model]["dp"] == 1.0
        for name in KINDS:
            assert factors.factor(model, name) > 0, (model, name)
            if not KINDS[name].synchronous:
                assert f"{name}/plain" in factors.table[model], (model, name)
                assert f"{name}/damped" in factors.table[model], (model, name)


def test_the_shipped_rates_are_the_faster_measured() -> None:
    """The table's ``stale_rates`` are what its own runs say: the damped rate where its seeds were faster."""
    report = json.loads(SHIPPED.read_text())
    factors = EpochFactors.load()
    for model, per in report["results"].items():
        cap = TARGETS[model][1]
        for name in ASYNC:
            seeds = {s: [r["epochs_to_target"] for r in per[s]["runs"]] for s in (name, f"{name}/damped")}
            expected = faster_rate(seeds[name], seeds[f"{name}/damped"], cap)
            assert factors.rate(model, name) == expected, (model, name)
    assert any(factors.rate(m, s) == "damped" for m in report["results"] for s in ASYNC)  # not all per sample


def test_lookups_and_fallbacks(tmp_path: Path) -> None:
    report = {
        "source": "a test",
        "epoch_factors": {
            "a": {"dp": 1.0, "2bw": 1.5, "2bw/plain": 3.0},
            "b": {"dp": 1.0, "2bw": 1.1, "2bw/plain": 2.0, "2bw/damped": 0.9},
        },
        "stale_rates": {"b": {"2bw": "damped"}},
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    factors = EpochFactors.load(tmp_path / "r.json")
    assert factors.source == "a test"
    assert factors.factor("a", "2bw") == 1.5 and factors.factor("b", "2bw", corrected=False) == 2.0
    assert factors.factor("c", "2bw") == 1.5  # an unmeasured model: the largest measured
    assert factors.factor("c", "2bw", corrected=False) == 3.0
    assert factors.factor("a", "flush") == 1.0  # nothing measured for it: a synchronous update is dp's
    # The correction's rate: the table's where it names one, else the rate per sample; one asked for is kept.
    assert (factors.rate("b", "2bw"), factors.rate("a", "2bw"), factors.rate("b", "2bw", "sample")) == (
        "damped",
        "sample",
        "sample",
    )
    assert factors.factor("b", "2bw") == 0.9 and factors.factor("b", "2bw", rate="sample") == 1.1
    assert factors.factor("a", "2bw", rate="damped") == 0.9  # a's damped rate unmeasured: the largest measured
    assert factors.factor("c", "2bw", rate="damped") == 0.9  # an unmeasured model: the largest measured
    assert factors.factor("b", "2bw", corrected=False, rate="damped") == 2.0  # no correction, no rate


def test_a_file_that_is_not_a_report_says_so(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="conveyor bench convergence --json"):
        EpochFactors.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read epoch factors"):
        EpochFactors.load(tmp_path / "missing.json")
    (tmp_path / "rate.json").write_text(json.dumps({"epoch_factors": {}, "stale_rates": {"m": {"2bw": "slow"}}}))
    with pytest.raises(ValueError, match="stale_rates has 'slow' where sample or damped belongs"):
        EpochFactors.load(tmp_path / "rate.json")
