"""The policies on tiny synthetic traces, with results checked by hand."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.elastic._bidbrain import simulate_spot
from conveyor.elastic._market import Billing, Market, MarketPrice
from conveyor.elastic._objective import Offer, hold_cost, paid_left, plan_holdings
from conveyor.elastic._throughput import Costs, Throughput

ONE = Throughput(batch=1, compute_s=1.0)  # one sample per machine-second, no all-reduce
FREE = Costs(revocation_s=0.0, addition_s=0.0, restart_s=0.0, steps_redone=0.0, checkpoint_s=0.0)


def market(name: str, events: list[tuple[float, str, int]], od: float = 3.6, spot: float = 0.36) -> Market:
    return Market(name, MarketPrice(name, od, spot), tuple(events))


def steady(n: int, name: str = "m", **prices: float) -> Market:
    return market(name, [(0.0, "add", s) for s in range(n)], **prices)


def test_on_demand_costs_fleet_times_price_times_time() -> None:
    out = simulate_spot("on-demand", [steady(4)], ONE, 3 * 3600.0, fleet=3)
    assert out.seconds == pytest.approx(3600.0)
    assert out.cost == pytest.approx(3 * 3.6 * 1.0)
    assert out.revocations == 0 and out.work == 3 * 3600.0


def test_checkpoint_restart_loses_exactly_the_work_since_the_last_checkpoint() -> None:
    # two machines; one is revoked at 1500 s and comes back at 1800 s; checkpoints every 1000 s of running
    events = [(0.0, "add", 0), (0.0, "add", 1), (1500.0, "remove", 1), (1800.0, "add", 1)]
    costs = Costs(restart_s=100.0, checkpoint_s=10.0, checkpoint_every_s=1000.0)
    out = simulate_spot("checkpoint-restart", [market("m", events)], ONE, 4000.0, fleet=2, machines=2, costs=costs)
    # restart at 0 (100 s), run 100..1100 (2000 samples), checkpoint 1100..1110, run 1110..1500 (780, lost)
    assert out.revocations == 1
    assert out.work_lost == pytest.approx(780.0)
    # back at 1800: restart to 1900, then 2000 samples more at 2 per second: done at 2900
    assert out.seconds == pytest.approx(2900.0)
    assert out.work == pytest.approx(4000.0)


def test_elastic_fixed_continues_with_the_survivors_and_takes_replacements() -> None:
    events = [(0.0, "add", 0), (0.0, "add", 1), (1000.0, "remove", 1), (2000.0, "add", 1)]
    costs = Costs(revocation_s=10.0, addition_s=5.0, steps_redone=1.0)
    out = simulate_spot(
        "elastic-fixed", [market("m", events)], ONE, 10_000.0, fleet=2, reliable=1, machines=2, costs=costs
    )
    assert (out.revocations, out.additions) == (1, 3)
    assert out.work_lost == pytest.approx(3.0)  # one step of three machines' samples
    # 5 s pause, 3/s to 1000 (2985), 10 s pause, 2/s to 2000 (1980, minus 3 redone), 5 s pause, then 3/s
    left = 10_000.0 - (2985.0 + 1980.0 - 3.0)
    assert out.seconds == pytest.approx(2005.0 + left / 3.0)


def test_bidbrain_never_holds_more_than_is_available() -> None:
    events = [(0.0, "add", s) for s in range(3)] + [(500.0, "remove", 2), (900.0, "add", 2), (900.0, "add", 3)]
    out = simulate_spot("bidbrain", [market("m", events)], ONE, 20_000.0, machines=8, costs=FREE)
    live = {0.0: 3, 500.0: 2, 900.0: 4}
    for t, held in out.held:
        cap = live[max(k for k in live if k <= t)] if held else 0
        assert held <= cap + 1  # the reliable machine is on top of the spot capacity


def test_bidbrain_decides_from_the_past_only() -> None:
    past = [(0.0, "add", s) for s in range(4)] + [(1000.0, "remove", 3)]
    a = simulate_spot("bidbrain", [market("m", [*past, (5000.0, "remove", 0)])], ONE, 1e6, costs=FREE)
    b = simulate_spot("bidbrain", [market("m", [*past, (5000.0, "add", 4)])], ONE, 1e6, costs=FREE)
    assert [h for h in a.held if h[0] < 5000.0] == [h for h in b.held if h[0] < 5000.0]


def test_bidbrain_with_equal_prices_and_no_revocations_holds_what_pays_off() -> None:
    # all-reduce makes a step 1 s longer beyond one machine: the reliable machine costs as much as 3 spot
    # ones, so more spot machines always lower the cost per sample, up to the 5 available
    x = Throughput(batch=1, compute_s=1.0, ring_s=(0.0, 1.0))
    out = simulate_spot("bidbrain", [steady(5, od=3.0, spot=1.0)], x, 1e5, machines=8, costs=FREE)
    assert max(h for _, h in out.held) == 6
    flat = simulate_spot("bidbrain", [steady(5, od=3.0, spot=1.0)], ONE, 1e5, machines=8, costs=FREE)
    assert max(h for _, h in flat.held) == 6  # linear throughput: every machine pays off


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'greedy'"):
        simulate_spot("greedy", [steady(2)], ONE, 10.0)
    with pytest.raises(ValueError, match="reliable >= 1"):
        simulate_spot("bidbrain", [steady(2)], ONE, 10.0, reliable=0)
    with pytest.raises(ValueError, match="revocation_s"):
        Costs(revocation_s=-1.0)


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(["on-demand", "elastic-fixed", "bidbrain"]),
    removals=st.lists(st.floats(10.0, 5000.0), max_size=4),
    spot=st.floats(0.05, 2.0),
)
def test_the_work_is_done_and_cost_grows_with_price(policy: str, removals: list[float], spot: float) -> None:
    events = [(0.0, "add", s) for s in range(6)] + [(t, "remove", i) for i, t in enumerate(sorted(removals))]
    events.sort(key=lambda e: e[0])
    runs = [
        simulate_spot(policy, [market("m", events, spot=p)], ONE, 20_000.0, fleet=2, costs=FREE)
        for p in (spot, 2 * spot)
    ]
    for out in runs:
        assert out.finished and out.work == pytest.approx(20_000.0)
        assert out.cost >= 0 and math.isfinite(out.seconds)
    if policy != "bidbrain":  # bidbrain may choose other machines at another price
        assert runs[1].cost >= runs[0].cost


HOURLY = Billing("hourly-2016")


def test_hold_cost_charges_started_hours_less_the_expected_refunds() -> None:
    assert hold_cost(0.9, 0.0, 50 / 60, HOURLY) == pytest.approx(0.9)  # a started hour in full
    assert hold_cost(0.9, 0.0, 2.25, HOURLY) == pytest.approx(2.7)  # three started hours
    assert hold_cost(0.9, 0.0, -10 / 60, HOURLY) == 0.0  # within the paid hour: nothing more
    assert hold_cost(0.9, 0.0, 0.0, HOURLY) == 0.0
    # 1.25 h at 0.5 revocations/h: the full hour is charged with prob. exp(-0.5), the quarter with exp(-0.125)
    assert hold_cost(1.0, 0.5, 1.25, HOURLY) == pytest.approx(0.6065307 + 0.8824969)
    assert hold_cost(3.6, 0.5, 1.25, Billing("per-second")) == pytest.approx(4.5)  # no refund per second


def test_paid_left_is_zero_at_the_end_of_a_billed_hour() -> None:
    assert paid_left(HOURLY, [0.0, 600.0, 3000.0], 3600.0) == pytest.approx([50 / 60, 1 / 6, 0.0])
    assert paid_left(Billing("per-second"), [0.0, 3570.0], 3600.0) == pytest.approx([30 / 3600, 0.0])


ONE_FREE = Costs(revocation_s=0.0, addition_s=0.0, steps_redone=0.0)


def test_a_machine_with_50_minutes_paid_is_free_to_keep() -> None:
    # a machine far dearer than the job is worth ($100/h): with 50 min of its hour paid, keeping it costs nothing
    # more when the job ends within them, so it is kept and used; at the end of its hour it is dropped
    rel = Offer(price=3.6, speed=1.0, rate=0.0, paid=(0.5,))
    for billing in (HOURLY, Billing("per-second")):
        paid = Offer(price=100.0, speed=1.0, rate=0.0, paid=(50 / 60,))
        assert plan_holdings(ONE, 1800.0, offers=[paid], reliable=rel, costs=ONE_FREE, billing=billing) == [1]
    over = Offer(price=100.0, speed=1.0, rate=0.0, paid=(0.0,))
    assert plan_holdings(ONE, 1800.0, offers=[over], reliable=rel, costs=ONE_FREE, billing=HOURLY) == [0]
    # even when the job outlasts its paid time, a machine within its hour is never given back before its end
    long = Offer(price=100.0, speed=1.0, rate=0.0, paid=(50 / 60,))
    assert plan_holdings(ONE, 1e6, offers=[long], reliable=rel, costs=ONE_FREE, billing=HOURLY) == [1]


def test_with_10_minutes_of_work_left_no_new_hour_is_started_on_8_machines() -> None:
    # 3 machines (2 spot, 1 reliable) with 40 min paid do the 1800 samples left in 10 min: free. Adding j of the
    # 8 free machines would finish in 1800 / (3 + j) s but start j hours at $0.36: J rises; per second they pay
    spot = Offer(price=0.36, speed=1.0, rate=0.0, paid=(40 / 60, 40 / 60), free=8)
    rel = Offer(price=3.6, speed=1.0, rate=0.0, paid=(40 / 60,))
    assert plan_holdings(ONE, 1800.0, offers=[spot], reliable=rel, costs=ONE_FREE, billing=HOURLY) == [2]
    now = Offer(price=0.36, speed=1.0, rate=0.0, paid=(0.0, 0.0), free=8)
    # per second: (3.6 + 0.36 h) * 1800 / (1 + h) s falls with h, so all 10
    assert plan_holdings(
        ONE,
        1800.0,
        offers=[now],
        reliable=Offer(3.6, 1.0, 0.0, paid=(0.0,)),
        costs=ONE_FREE,
        billing=Billing("per-second"),
    ) == [10]


def test_new_hours_are_bought_only_as_far_as_the_remaining_work_needs() -> None:
    # as above, but the reliable machine's hour ends in 5.5 min: finishing later starts a $3.6 on-demand hour.
    # j more spot machines: J = 0.36 j (+ 3.6 if 1800 / (3 + j) s > 330 s): j = 3 (done in 300 s) costs $1.08,
    # j = 2 (360 s) $4.32, j = 4 $1.44, all 8 $2.88
    spot = Offer(price=0.36, speed=1.0, rate=0.0, paid=(40 / 60, 40 / 60), free=8)
    rel = Offer(price=3.6, speed=1.0, rate=0.0, paid=(5.5 / 60,))
    assert plan_holdings(ONE, 1800.0, offers=[spot], reliable=rel, costs=ONE_FREE, billing=HOURLY) == [5]


def test_a_revocation_prone_market_is_cheaper_hourly_only() -> None:
    # two markets at $1/h, one revoked 0.7 times per machine-hour (30 s lost each); a reliable machine at $1/h of
    # speed 0.5; 3600 samples at 1/s per unit of speed. Hourly, with the risky one: T = 3600 / (1.5 (1 - 0.7 * 30
    # / 3600)) s = 0.671 h, J = 1 + exp(-0.7 * 0.671) = 1.63; with the steady one 1 + 1 = 2; both 2.75; neither
    # (2 h) 2. Per second: both (3 $/h for 0.402 h) 1.21 beat one (1.33, 1.34) and neither (2)
    steady_, risky = (Offer(price=1.0, speed=1.0, rate=r, free=1) for r in (0.0, 0.7))
    rel = Offer(price=1.0, speed=0.5, rate=0.0, paid=(0.0,))
    costs = Costs(revocation_s=30.0, addition_s=0.0, steps_redone=0.0)
    assert plan_holdings(ONE, 3600.0, offers=[steady_, risky], reliable=rel, costs=costs, billing=HOURLY) == [0, 1]
    assert plan_holdings(
        ONE, 3600.0, offers=[steady_, risky], reliable=rel, costs=costs, billing=Billing("per-second")
    ) == [
        1,
        1,
    ]


@settings(max_examples=20, deadline=None)
@given(removals=st.lists(st.floats(10.0, 20_000.0), max_size=6), work=st.floats(2e3, 1e5))
def test_hourly_bidbrain_gives_machines_back_only_at_the_end_of_a_paid_hour(removals: list[float], work: float) -> None:
    events = [(0.0, "add", s) for s in range(6)] + [(t, "remove", i) for i, t in enumerate(sorted(removals))]
    events.sort(key=lambda e: e[0])
    out = simulate_spot("bidbrain", [market("m", events)], ONE, work, machines=6, billing="hourly-2016", costs=FREE)
    assert out.finished and out.work == pytest.approx(work)
    for _, start, end, why in out.spans:
        if why == "released":
            hours = (end - start) / 3600.0
            assert hours == pytest.approx(round(hours)) and round(hours) >= 1


def test_checkpoint_restart_pays_its_idle_survivors_and_no_reliable_tier() -> None:
    # the scenario of the checkpoint-restart test above, at $0.36/h ($0.0001/s): the survivor is held 0..2900 s
    # (idle 1500..1800 s, waiting for its peer), the revoked machine 0..1500 s, its replacement 1800..2900 s
    events = [(0.0, "add", 0), (0.0, "add", 1), (1500.0, "remove", 1), (1800.0, "add", 1)]
    costs = Costs(restart_s=100.0, checkpoint_s=10.0, checkpoint_every_s=1000.0)
    out = simulate_spot("checkpoint-restart", [market("m", events)], ONE, 4000.0, fleet=2, machines=2, costs=costs)
    assert out.cost == pytest.approx((2900.0 + 1500.0 + 1100.0) * 0.0001)
    assert set(out.machine_hours) == {"m"}


def test_the_reliable_tier_is_charged_on_demand_in_the_elastic_policies_only() -> None:
    for policy in ("elastic-fixed", "bidbrain"):
        out = simulate_spot(policy, [steady(4)], ONE, 20_000.0, fleet=2, reliable=2, costs=FREE)
        assert out.machine_hours["m on-demand"] == pytest.approx(2 * out.seconds / 3600.0)
    out = simulate_spot("on-demand", [steady(4)], ONE, 20_000.0, fleet=2, costs=FREE)
    assert out.machine_hours == {"m on-demand": pytest.approx(2 * out.seconds / 3600.0)}  # the fleet, no more
