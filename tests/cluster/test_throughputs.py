"""Throughput sources: Gavel's table and online estimates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conveyor.cluster._generate import GAVEL_JOB_TYPES
from conveyor.cluster._problem import Problem
from conveyor.cluster._throughputs import (
    JobKey,
    OnlineThroughputs,
    ThroughputTable,
    default_gavel_path,
)
from conveyor.cluster._trace import TraceJob

GAVEL = Path(__file__).resolve().parents[3] / "shared" / "gavel" / "simulation_throughputs.json"


@pytest.fixture(scope="module")
def gavel() -> ThroughputTable:
    if not GAVEL.is_file():
        pytest.skip(f"Gavel's throughput table not found at {GAVEL} (only CI and developer machines have ../shared)")
    return ThroughputTable.load(GAVEL)


def test_the_default_path_is_beside_the_checkout() -> None:
    assert default_gavel_path() == GAVEL


def test_known_values(gavel: ThroughputTable) -> None:
    # Read off simulation_throughputs.json by hand.
    assert gavel.alone("ResNet-18 (batch size 16)", 1, "v100") == 32.353384328946916
    assert gavel.alone("A3C", 1, "k80") == 3.4387678290723933
    assert gavel.alone("LM (batch size 80)", 4, "p100") == 54.99554190953061
    assert gavel.alone("ResNet-50 (batch size 128)", 2, "k80") == 0.0  # measured 0: it cannot run there
    rn16, rn64 = ("ResNet-18 (batch size 16)", 1), ("ResNet-18 (batch size 64)", 1)
    assert gavel.colocated(rn16, rn64, "v100") == (32.353384328946916, 24.093231895382736)
    assert gavel.colocated(rn64, rn16, "v100") == (24.093231895382736, 32.353384328946916)


def test_every_type_on_every_device(gavel: ThroughputTable) -> None:
    assert gavel.device_types == ("k80", "p100", "v100")
    assert set(gavel.job_types) == set(GAVEL_JOB_TYPES)
    for device in gavel.device_types:
        assert {t for t, _ in gavel.alone_rates[device]} == set(GAVEL_JOB_TYPES)
        assert len(gavel.alone_rates[device]) == 19 * 4 + 7
    assert gavel.scale_factors("LM (batch size 5)") == (1, 2, 4, 8) and gavel.scale_factors("A3C") == (1,)
    wide = ThroughputTable.load(GAVEL, unconsolidated=True)
    assert wide.device_types == (
        "k80",
        "p100",
        "v100",
        "v100_unconsolidated",
        "p100_unconsolidated",
        "k80_unconsolidated",
    )


def test_matrix_and_pairs_fill_a_problem(gavel: ThroughputTable) -> None:
    jobs: list[JobKey | TraceJob] = [
        TraceJob("ResNet-18 (batch size 16)", 100, 1, 0.0),
        ("ResNet-18 (batch size 64)", 1),
        ("A3C", 1),
        ("LM (batch size 20)", 2),
        ("Transformer (batch size 32)", 2),
        ("ResNet-50 (batch size 128)", 4),
    ]
    types = ("v100", "k80")
    matrix = gavel.matrix(jobs, types)
    assert matrix.shape == (6, 2) and matrix[0, 0] == 32.353384328946916 and matrix[5, 1] == 0.0
    pairs = gavel.pairs(jobs, types)
    # Pairs of equal scale factor only; Gavel's table measured sharing on one device only (its others are 0).
    assert set(pairs) == {(0, 1), (0, 2), (1, 2)}
    assert all(v.shape == (2, 2) for v in pairs.values())
    assert pairs[(0, 1)][0].tolist() == [32.353384328946916, 24.093231895382736]
    problem = Problem(
        tuple(range(6)), types, matrix, np.array([1, 1, 1, 2, 2, 4]), capacity=np.array([8, 8]), pair_throughputs=pairs
    )
    assert problem.throughputs.shape == (6, 2)
    assert gavel.matrix(jobs).shape == (6, 3)


def test_unknown_jobs_and_devices(gavel: ThroughputTable) -> None:
    with pytest.raises(ValueError, match=r"unknown job type 'GPT-4'; the throughput table .*json knows 26 types"):
        gavel.matrix([("GPT-4", 1)])
    with pytest.raises(ValueError, match=r"has no 'A3C' on 2 devices \(it has scale factors \[1\]\): change the"):
        gavel.matrix([("A3C", 2)])
    with pytest.raises(ValueError, match=r"unknown device type 'tpu'; the throughput table .* has \['k80', 'p100'"):
        gavel.alone("A3C", 1, "tpu")


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no Gavel throughput table at .*nothing.json: put https://github.com/"):
        ThroughputTable.load(tmp_path / "nothing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad.json is not JSON"):
        ThroughputTable.load(tmp_path / "bad.json")
    (tmp_path / "odd.json").write_text(json.dumps({"v100": {"A3C": {"null": 1.0}}}))
    with pytest.raises(ValueError, match=r"odd.json: device type 'v100' is not in Gavel's format"):
        ThroughputTable.load(tmp_path / "odd.json")
    (tmp_path / "evil.json").write_text(json.dumps({"v100": {"__import__('os')": {"null": 1.0}}}))
    with pytest.raises(ValueError, match=r"not in Gavel's format"):  # literal_eval, never eval
        ThroughputTable.load(tmp_path / "evil.json")


def test_pairs_that_can_never_share_are_left_out() -> None:
    t = ThroughputTable.from_dict(
        {
            "v100": {
                "('A', 1)": {"null": 1.0, "('B', 1)": [0.0, 0.0], "('C', 1)": [0.5, 0.4]},
                "('B', 1)": {"null": 1.0},
                "('C', 1)": {"null": 1.0},
                "('D', 2)": {"null": 1.0},
            }
        }
    )
    pairs = t.pairs([("A", 1), ("B", 1), ("C", 1), ("D", 2)])
    assert list(pairs) == [(0, 2)] and pairs[(0, 2)].tolist() == [[0.5, 0.4]]
    assert t.colocated(("B", 1), ("C", 1), "v100") is None


def test_online_estimates_converge_to_the_measured_rate() -> None:
    rng = np.random.default_rng(0)
    est = OnlineThroughputs({(("A", 1), "v100"): 10.0, (("A", 1), "k80"): 2.5})
    for _ in range(200):
        seconds = rng.uniform(10, 100)
        est.record(("A", 1), "v100", steps=7.0 * seconds * rng.uniform(0.9, 1.1), seconds=seconds)
    assert est.get(("A", 1), "v100") == pytest.approx(7.0, rel=0.01)
    assert est.get(("A", 1), "k80") == pytest.approx(7.0 * 2.5 / 10.0, rel=0.01)  # the prior's ratio


def test_other_jobs_measured_on_both_types_correct_the_priors_ratio() -> None:
    # Priors by cores (1.0 and 0.25: ratio 4); B measured 16/s fast and 2/s slow (ratio 8), C 20/s and 2.5/s:
    # A, measured only on fast at 12/s, is estimated on slow at 12 / 4 / 2 = 1.5, not 3.
    est = OnlineThroughputs({(job, t): c for job in "ABC" for t, c in (("fast", 1.0), ("slow", 0.25))})
    for job, fast, slow in (("B", 16.0, 2.0), ("C", 20.0, 2.5)):
        est.record(job, "fast", fast * 10, 10.0)
        est.record(job, "slow", slow * 10, 10.0)
    est.record("A", "fast", 120.0, 10.0)
    assert est.get("A", "slow") == pytest.approx(1.5)
    assert est.get("B", "slow") == pytest.approx(2.0)  # its own measurement, untouched
    alone = OnlineThroughputs({("A", "fast"): 1.0, ("A", "slow"): 0.25})
    alone.record("A", "fast", 120.0, 10.0)
    assert alone.get("A", "slow") == pytest.approx(3.0)  # nobody measured on both: the priors' ratio


def test_online_estimates_weigh_priors_and_follow_changes() -> None:
    blended = OnlineThroughputs({("A", "v100"): 10.0}, prior_weight_s=100.0)
    blended.record("A", "v100", steps=400.0, seconds=100.0)
    assert blended.get("A", "v100") == 7.0  # the prior as 100 s at 10/s, then 100 s at 4/s
    moving = OnlineThroughputs(halflife_s=60.0)
    for _ in range(60):
        moving.record("A", "v100", steps=100.0, seconds=10.0)
    for _ in range(60):
        moving.record("A", "v100", steps=20.0, seconds=10.0)
    assert moving.get("A", "v100") == pytest.approx(2.0, rel=0.01)  # the old 10/s forgotten


def test_online_estimates_for_unknown_jobs() -> None:
    est = OnlineThroughputs({("A", "v100"): 8.0, ("A", "k80"): 2.0, ("B", "v100"): 4.0, ("B", "k80"): 2.0}, default=3.0)
    assert est.get("new", "v100") == 6.0 and est.get("new", "k80") == 2.0  # the mean of known priors there
    assert est.get("new", "tpu") == 3.0  # nothing known: the stated default
    est.record("new", "v100", steps=50.0, seconds=10.0)
    assert est.get("new", "k80") == pytest.approx(5.0 * math.sqrt(0.25 * 0.5))  # the geometric mean ratio
    assert est.measured("new", "k80") is None and est.measured("new", "v100") == 5.0
    est.set_prior("A", "v100", None)
    assert est.get("A", "v100") == 4.0
    with pytest.raises(ValueError, match="a measurement needs steps >= 0 and seconds > 0"):
        est.record("A", "v100", 10.0, 0.0)
    with pytest.raises(ValueError, match=r"prior throughput -1\.0 of 'A' on v100 must be finite and >= 0"):
        est.set_prior("A", "v100", -1.0)


def test_from_gavels_table(gavel: ThroughputTable) -> None:
    est = OnlineThroughputs.from_table(gavel)
    assert est.get(("A3C", 1), "k80") == 3.4387678290723933
