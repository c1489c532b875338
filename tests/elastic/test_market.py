"""Billing rules on hand-computed cases, prices, and traces read as markets."""

import pytest

from conveyor.elastic._market import PRICES, Billing, Market, MarketPrice, read_markets


def test_per_second_billing_charges_the_seconds_with_a_minute_minimum() -> None:
    b = Billing("per-second")
    assert b.charge(3.6, 100.0, 1100.0) == pytest.approx(1.0)  # 1000 s at $0.001/s
    assert b.charge(3.6, 0.0, 10.0) == pytest.approx(0.06)  # 60 s minimum
    assert b.charge(3.6, 0.0, 10.0, revoked=True) == pytest.approx(0.06)  # no refund per second


def test_hourly_2016_charges_started_hours_and_refunds_a_revoked_partial_hour() -> None:
    b = Billing("hourly-2016")
    assert b.charge(2.0, 0.0, 1.0) == 2.0  # a started hour in full
    assert b.charge(2.0, 0.0, 3600.0) == 2.0
    assert b.charge(2.0, 0.0, 3601.0) == 4.0
    assert b.charge(2.0, 0.0, 3601.0, revoked=True) == 2.0  # the second, partial hour is free
    assert b.charge(2.0, 0.0, 1800.0, revoked=True) == 0.0  # revoked in its first hour: free
    assert b.paid_until(0.0, 4000.0) == 7200.0


def test_bad_billing_and_prices_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="unknown billing 'monthly'"):
        Billing("monthly")
    with pytest.raises(ValueError, match="prices must be >= 0"):
        MarketPrice("x", -1.0, 0.5)
    with pytest.raises(ValueError, match="end >= start"):
        Billing().charge(1.0, 10.0, 5.0)


def test_a_trace_file_becomes_a_market_with_its_live_counts(tmp_path) -> None:
    trace = tmp_path / "p3-trace.csv"
    trace.write_text("0,add,a\n0,add,b\n60000,add,c\n120000,remove,a\n")
    m = Market.from_trace(trace)
    assert m.price == PRICES["p3-trace"]
    assert m.counts() == [(0.0, 2), (60.0, 3), (120.0, 2)]
    assert (m.peak, m.duration) == (3, 120.0)


def test_missing_malformed_and_unpriced_traces_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_markets([tmp_path / "p3-trace.csv"])
    bad = tmp_path / "g4dn-trace.csv"
    bad.write_text("0,add,a\nnonsense\n")
    with pytest.raises(ValueError, match="line 2"):
        read_markets([bad])
    unpriced = tmp_path / "other.csv"
    unpriced.write_text("0,add,a\n")
    with pytest.raises(ValueError, match=r"no prices for trace other\.csv"):
        read_markets([unpriced])
