"""The replay: bills, losses, restarts, the deadline's safety net and moves, on traces whose answer is known."""

import numpy as np
import pytest

from conveyor.config import MARKET_POLICIES
from conveyor.errors import InputError
from conveyor.markets import (
    Job,
    MarketTrace,
    Overheads,
    PolicySettings,
    Pricing,
    Run,
    Study,
    simulate_markets,
)

FREE = Overheads(revocation_s=0.0, addition_s=0.0, restart_s=0.0, checkpoint_s=0.0)
SPEEDS = {"v100_1": 1.0, "k80_1": 0.25}


def _trace(counts: list[int], zone: str = "us-east-1a", kind: str = "v100_1") -> MarketTrace:
    return MarketTrace(zone, kind, 3600.0, np.array(counts, dtype=np.int64))


def _study(traces: list[MarketTrace], work: float = 10.0, deadline: float = 15.0, **kw: object) -> Study:
    job = Job(work=work, deadline_h=deadline)
    return Study(traces, job, SPEEDS, overheads=FREE, warmup_h=0.0, **kw)  # type: ignore[arg-type]


def test_on_demand_and_spot_cost_their_prices_when_nothing_is_lost() -> None:
    study = _study([_trace([1] * 40)])
    od, spot = simulate_markets(study, "on-demand", 0), simulate_markets(study, "spot-restart", 0)
    assert od.finish_h == pytest.approx(10.0) and od.cost_usd == pytest.approx(30.6)
    assert spot.finish_h == pytest.approx(10.0) and spot.cost_usd == pytest.approx(10 * 0.918)
    assert od.deadline_met and spot.deadline_met and spot.losses == 0


def test_a_loss_sends_a_restarting_job_back_to_its_checkpoint_but_not_an_elastic_one() -> None:
    """Two zones; the home zone is lost for an hour at hour 3 (the checkpoint is 10 min old at most)."""
    home = _trace([1, 1, 1, 0, 1] + [1] * 40, zone="us-east-1a")
    other = _trace([1] * 45, zone="us-east-1b")
    o = Overheads(revocation_s=0.0, addition_s=0.0, restart_s=0.0, checkpoint_s=0.0, checkpoint_every_s=7200.0)
    study = Study([home, other], Job(work=10.0, deadline_h=15.0), SPEEDS, overheads=o, warmup_h=0.0)
    restart = simulate_markets(study, "spot-restart", 0)
    assert restart.losses == 1 and restart.work_lost == pytest.approx(1.0)  # the hour since the checkpoint at 2 h
    assert restart.finish_h == pytest.approx(12.0)  # an hour lost, an hour waiting
    elastic = simulate_markets(study, "portfolio", 0)
    assert elastic.work_lost == 0.0 and elastic.deadline_met


def test_the_deadline_is_kept_by_on_demand_when_spot_never_comes() -> None:
    study = _study([_trace([0] * 40)])
    for policy in ("spot-restart", "uniform-progress", "portfolio", "portfolio-moves"):
        run = simulate_markets(study, policy, 0)
        assert run.deadline_met, policy
        assert run.on_demand_h == pytest.approx(10.0) and run.spot_h == 0.0


def test_uniform_progress_buys_on_demand_only_while_behind_its_line() -> None:
    """Spot for the first 5 hours, then none: uniform progress waits until it falls behind ``10 h x t / 20 h``
    (after 10 h), the greedy policy until the safety net (5 h of work left, 2 ticks of reserve: 13 h)."""
    study = _study([_trace([1] * 5 + [0] * 35)], work=10.0, deadline=20.0)
    up, greedy = simulate_markets(study, "uniform-progress", 0), simulate_markets(study, "spot-restart", 0)
    assert up.deadline_met and greedy.deadline_met
    assert up.spot_h == pytest.approx(5.0) and 0 < up.on_demand_h <= 5.0 + 1e-9

    def first_on_demand(run: Run) -> float:
        return next(h for h, _, od in run.held if od)

    assert first_on_demand(up) == 11.0 and first_on_demand(greedy) == 13.0


def test_hourly_billing_leaves_a_revoked_partial_hour_free() -> None:
    """Spot for 5 ticks of 30 min, revoked at 2.5 h: per second 2.5 h are paid, hourly-2016 2 h (the revoked
    partial hour is free); then on demand."""
    trace = MarketTrace("us-east-1a", "v100_1", 1800.0, np.array([1] * 5 + [0] * 200, dtype=np.int64))
    for billing, paid_h in (("per-second", 2.5), ("hourly-2016", 2.0)):
        study = Study(
            [trace],
            Job(work=10.0, deadline_h=60.0),
            SPEEDS,
            pricing=Pricing(0.3, billing),
            overheads=FREE,
            warmup_h=0.0,
        )
        run = simulate_markets(study, "spot-restart", 0)
        assert run.spot_h == pytest.approx(2.5)
        on_demand_usd = 3.06 * (run.on_demand_h if billing == "per-second" else np.ceil(run.on_demand_h - 1e-9))
        assert run.cost_usd - on_demand_usd == pytest.approx(paid_h * 0.918)


def test_moves_go_where_spot_is_and_pay_for_the_move() -> None:
    """V100 spot vanishes after 2 h; K80 spot stays: the moving portfolio goes to the K80s after its move period."""
    v100 = _trace([1, 1] + [0] * 200, zone="us-west-2a")
    k80 = _trace([1] * 202, zone="us-west-2a", kind="k80_1")
    settings = PolicySettings(move_every_h=1.0)
    study = Study([v100, k80], Job(work=4.0, deadline_h=100.0), SPEEDS, overheads=FREE, settings=settings, warmup_h=0.0)
    moved, stayed = simulate_markets(study, "portfolio-moves", 0), simulate_markets(study, "portfolio", 0)
    assert moved.moves >= 1 and moved.deadline_met
    assert moved.on_demand_h < stayed.on_demand_h


def test_bidbrain_runs_on_the_same_window() -> None:
    study = _study([_trace([1] * 40), _trace([1] * 40, zone="us-east-1b")])
    run = simulate_markets(study, "bidbrain", 0)
    assert run.finish_h < 15.0 and run.cost_usd > 0 and run.on_demand_h > 0  # its reliable on-demand tier


def test_every_policy_runs_and_bad_inputs_are_refused_in_one_line() -> None:
    study = _study([_trace([1, 0] * 20)])
    assert {simulate_markets(study, p, 0).policy for p in MARKET_POLICIES} == set(MARKET_POLICIES)
    with pytest.raises(InputError, match="unknown policy 'cheap'"):
        simulate_markets(study, "cheap", 0)
    with pytest.raises(InputError, match="too short"):
        _study([_trace([1] * 10)]).starts(3)
    with pytest.raises(InputError, match="no training speed"):
        Study([_trace([1] * 10, kind="t4_1")], Job(work=1.0), SPEEDS)
    with pytest.raises(InputError, match="spot discount"):
        Pricing(1.5)


def test_overheads_refuse_a_negative_or_zero_period() -> None:
    with pytest.raises(InputError, match="overhead restart_s must be a finite number >= 0"):
        Overheads(restart_s=-1.0)
    with pytest.raises(InputError, match="overhead checkpoint_every_s must be > 0"):
        Overheads(checkpoint_every_s=0.0)
