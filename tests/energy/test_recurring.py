"""A recurrence's sizes, learning rate, running cost and early stop, and its store record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conveyor.energy import CostMeter, JobSettings, RecurrenceStore, Recurring, candidate_sizes, scaled_lr


def test_candidate_sizes_and_learning_rates() -> None:
    assert candidate_sizes(64, 1437) == (8, 16, 32, 64, 128, 256, 512)
    assert candidate_sizes(64, 100) == (8, 16, 32, 64)  # none above the training set (but b0 itself)
    assert scaled_lr(0.05, 16, 64, "sgd") == pytest.approx(0.0125)  # linear
    assert scaled_lr(0.01, 16, 64, "adam") == pytest.approx(0.005)  # square root


def test_cost_meter_stops_before_an_epoch_would_pass_the_threshold() -> None:
    # eta 0.5, 100 W: an epoch of 2 s and 150 J costs 75 + 100 = 175; the threshold 500 allows two (350 + 175
    # would pass it after the second).
    meter = CostMeter(eta=0.5, max_power_w=100.0, stop_above=500.0)
    meter.add_epoch(150.0, 2.0)
    assert meter.cost == 175.0 and not meter.over
    meter.add_epoch(150.0, 2.0)
    assert meter.cost == 350.0 and meter.over
    assert not CostMeter(0.5, 100.0, math.inf).over
    timed = CostMeter(eta=0.0, max_power_w=1.0, stop_above=math.inf)
    timed.add_epoch(None, 3.0)
    assert timed.cost == 3.0  # time alone: no meter needed
    with pytest.raises(ValueError, match="the cost needs energy"):
        CostMeter(0.5, 100.0, math.inf).add_epoch(None, 1.0)


def test_a_recurrence_is_recorded_or_abandoned(tmp_path: Path) -> None:
    store = RecurrenceStore(tmp_path / "r.sqlite")
    settings = JobSettings((32, 64), default=64, target=0.9, eta=0.0, beta=2.0)
    ok = Recurring(store, "job", settings)
    assert ok.start().batch_size == 64
    ok.end(cost=10.0, energy_j=None, time_s=10.0, reached=True, epochs=4)
    failed = Recurring(store, "job", settings)
    assert failed.start().batch_size == 32
    failed.fail(interrupted=True)  # Ctrl-C
    assert [r["state"] for r in store.rows("job")] == ["finished", "abandoned"]
    again = Recurring(store, "job", settings)
    assert again.start().batch_size == 32  # the abandoned one taught nothing
    again.fail()  # an error: 32 missed the target
    assert [r["state"] for r in store.rows("job")][-1] == "failed"
    assert store.history("job")[-1].reached is False
