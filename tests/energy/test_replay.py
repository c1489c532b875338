"""Trace replay: hand-computed recurrences on a tiny trace, and Zeus' own simulator on a published one."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

import pytest

from conveyor.energy import Workload, WorkloadTrace, load_traces, replay, search_policy

SHARED = Path(__file__).resolve().parents[3] / "shared" / "zeus-traces"
TINY = Workload("toy", "net", "sgd", target=0.9, max_epochs=10, default_batch_size=32)


def _tiny() -> WorkloadTrace:
    # 32 reaches in 4 epochs (both seeds), 64 in 3 or never; two power limits each.
    return WorkloadTrace(
        TINY,
        "gpu",
        target_epochs={32: [4.0, 4.0], 64: [3.0, math.nan]},
        power={32: {100: (10.0, 90.0), 200: (8.0, 150.0)}, 64: {100: (6.0, 95.0), 200: (5.0, 160.0)}},
    )


def test_the_power_limit_of_least_epoch_cost() -> None:
    trace = _tiny()
    # eta 0.5, max power 200: 32 @ 100 W: (45 + 100) * 10 = 1450; @ 200 W: (75 + 100) * 8 = 1400 -> 200.
    assert trace.epoch_costs(32, 0.5) == {100: 1450.0, 200: 1400.0} and trace.best_limit(32, 0.5) == 200
    assert trace.best_limit(32, 1.0) == 100  # energy alone: 900 J against 1200 J per epoch


def test_default_policy_by_hand() -> None:
    # Always 32 at 200 W, no early stopping: 4 epochs of 8 s at 150 W = 32 s, 4800 J; cost at eta 0.5:
    # 0.5 * 4800 + 0.5 * 200 * 32 = 5600, for each of 3 recurrences.
    out = replay(_tiny(), lambda history: 32, recurrences=3, eta=0.5, beta=None, limit=lambda size: 200)
    assert (out.energy_j, out.time_s, out.cost) == (3 * 4800.0, 3 * 32.0, 3 * 5600.0)
    assert [t[3] for t in out.tries] == [True] * 3


def test_first_epoch_profiles_every_limit_and_failures_are_retried() -> None:
    # Just-in-time limits: 32's first epoch costs the mean over limits (9 s, (900 + 1200) / 2 = 1050 J),
    # the other 3 epochs run at 200 W: 24 s, 3600 J -> 33 s, 4650 J, cost 0.5 * 4650 + 100 * 33 = 5625.
    out = replay(_tiny(), lambda history: 32, recurrences=1, eta=0.5, beta=None)
    assert (out.time_s, out.energy_j, out.cost) == (33.0, 4650.0, 5625.0)
    # 64 never reaches on one of its two seeds: a recurrence is tried again until a try reaches.
    out = replay(_tiny(), lambda history: 64, recurrences=20, eta=0.5, beta=None, seed=3)
    reached = [t[3] for t in out.tries]
    assert reached.count(True) == 20 and reached.count(False) > 0


def test_early_stopping_cuts_a_try_at_beta_times_the_least_cost() -> None:
    # First recurrence 32: 5625 (above). Then 64 at 200 W (its epoch cost (80 + 100) * 5 = 900): beta 1.2 gives
    # a budget of floor(6750 / 900) = 7 epochs; on the never-reaching seed the try stops there, not at 10.
    choices = iter([32] + [64] * 40)
    out = replay(_tiny(), lambda history: next(choices), recurrences=8, eta=0.5, beta=1.2, seed=3)
    failed = [t for t in out.tries if not t[3]]
    assert failed, "seed 3 never drew the failing path"
    epoch_cost = 900.0
    assert all(t[2] <= 7 * epoch_cost + 1e-9 for t in failed[1:])  # after the first try of 64 (it profiles)


def test_the_search_policy_explores_then_settles() -> None:
    out = replay(_tiny(), search_policy(_tiny(), beta=2.0, seed=0), recurrences=10, eta=0.5, beta=2.0)
    assert [t[0] for t in out.tries][:1] == [32]  # the default first
    assert sum(t[3] for t in out.tries) == 10


@pytest.fixture
def librispeech() -> WorkloadTrace:
    if not (SHARED / "summary_train.csv").exists():
        pytest.skip(f"Zeus' traces not found at {SHARED} (only CI and developer machines have ../shared)")
    return load_traces(SHARED, [Workload("librispeech", "deepspeech2", "adamw", 40.0, 16, 192)], "v100")[0]


def test_against_zeus_own_simulator(librispeech: WorkloadTrace) -> None:
    # The same job in Zeus' trace-driven simulator (zeus._legacy.simulate): the same pruning walk, and a total
    # cost within 10% (their Thompson sampling draws differ from ours).
    pytest.importorskip("pandas")
    import pandas as pd
    from zeus._legacy.job import Job
    from zeus._legacy.policy.optimizer import JITPowerLimitOptimizer, PruningGTSBatchSizeOptimizer
    from zeus._legacy.simulate import Simulator
    from zeus.utils.metric import zeus_cost as their_cost

    train = pd.read_csv(SHARED / "summary_train.csv")
    power = pd.read_csv(SHARED / "summary_power_v100.csv")
    sim = Simulator(
        train,
        power,
        PruningGTSBatchSizeOptimizer(seed=1, verbose=False),
        JITPowerLimitOptimizer(verbose=False),
        seed=1,
        verbose=False,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = sim.simulate_one_job(Job("librispeech", "deepspeech2", "adamw", 40.0, 16, 192), 30, 2.0, 0.5)
    ours = replay(librispeech, search_policy(librispeech, beta=2.0, seed=1), recurrences=30, eta=0.5, beta=2.0, seed=1)
    assert [int(h.bs) for h in theirs][:25] == [t[0] for t in ours.tries][:25]
    their_total = sum(their_cost(h.energy, h.time, 0.5, 250) for h in theirs)
    assert ours.cost == pytest.approx(their_total, rel=0.10)


def test_missing_traces_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no Zeus trace at .*summary_train\.csv: give --traces"):
        load_traces(tmp_path, [TINY], "v100")
