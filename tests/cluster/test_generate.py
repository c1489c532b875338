"""Gavel's synthetic jobs: the distributions of sizes, types, durations and arrivals, and determinism."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conveyor.cluster._generate import DISTRIBUTED_FAMILIES, GAVEL_JOB_TYPES, generate_jobs
from conveyor.cluster._throughputs import ThroughputTable
from conveyor.cluster._trace import read_trace, write_trace

GAVEL = Path(__file__).resolve().parents[3] / "shared" / "gavel" / "simulation_throughputs.json"


def distributed(job_type: str) -> bool:
    return job_type.split(" (")[0] in DISTRIBUTED_FAMILIES


# Gavel's shape without its numbers, so the distributions are tested on every checkout: every type on one
# device, the distributed ones on 2, 4 and 8 too, at a made-up rate per type and scale.
SYNTHETIC = ThroughputTable.from_dict(
    {
        "v100": {
            repr((t, s)): {"null": 1.0 + i + s}
            for i, t in enumerate(GAVEL_JOB_TYPES)
            for s in ((1, 2, 4, 8) if distributed(t) else (1,))
        }
    }
)
N = 20_000


@pytest.fixture(scope="module")
def many() -> list:
    return generate_jobs(N, jobs_per_hour=12.0, seed=7, priorities=True, slos=True, table=SYNTHETIC)


def test_gavels_26_job_types() -> None:
    assert len(GAVEL_JOB_TYPES) == len(set(GAVEL_JOB_TYPES)) == 26
    assert sum(map(distributed, GAVEL_JOB_TYPES)) == 19


def test_scale_factors_follow_philly(many: list) -> None:
    counts = Counter(j.scale_factor for j in many)
    for scale, p in {1: 0.70, 2: 0.10, 4: 0.15, 8: 0.05}.items():
        assert abs(counts[scale] / N - p) < 0.02, (scale, counts[scale] / N)
    assert all(distributed(j.job_type) for j in many if j.scale_factor > 1)
    single = Counter(j.job_type for j in many if j.scale_factor == 1)
    assert set(single) == set(GAVEL_JOB_TYPES)  # uniform over all 26 on one device
    assert max(single.values()) / min(single.values()) < 1.25
    assert {j.scale_factor for j in generate_jobs(500, jobs_per_hour=10.0, multi_gpu=False, table=SYNTHETIC)} == {1}


def test_durations_follow_the_mixture(many: list) -> None:
    exponent = np.log10([j.duration_s / 60 for j in many])
    for p in (0.05, 0.2, 0.4, 0.6, 0.79, 0.85, 0.95):
        # 80% uniform on [1.5, 3], 20% on [3, 4]: the quantile of the mixture, exactly.
        expected = 1.5 + 1.5 * p / 0.8 if p <= 0.8 else 3.0 + (p - 0.8) / 0.2
        assert abs(np.quantile(exponent, p) - expected) < 0.04, p
    assert exponent.min() >= 1.5 and exponent.max() <= 4.0


def test_steps_are_the_duration_at_the_reference_rate(many: list) -> None:
    rates = SYNTHETIC.alone_rates["v100"]
    for j in many[:200]:
        assert j.total_steps == int(j.duration_s * rates[(j.job_type, j.scale_factor)])


def test_arrivals_are_poisson(many: list) -> None:
    arrivals = np.array([j.arrival_s for j in many])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    gaps = np.diff(arrivals)
    assert abs(gaps.mean() / (3600 / 12.0) - 1) < 0.05
    assert abs(np.median(gaps) / (np.log(2) * 3600 / 12.0) - 1) < 0.05  # exponential, not just the right mean
    static = generate_jobs(50, jobs_per_hour=0, table=SYNTHETIC)
    assert {j.arrival_s for j in static} == {0.0}


def test_priorities_and_slos(many: list) -> None:
    weights = Counter(j.priority_weight for j in many)
    assert set(weights) == {1.0, 5.0} and abs(weights[5.0] / N - 0.2) < 0.02
    slos = Counter(j.slo for j in many)
    assert set(slos) == {1.2, 2.0, 10.0}
    for slo, p in {1.2: 0.33, 2.0: 0.34, 10.0: 0.33}.items():
        assert abs(slos[slo] / N - p) < 0.02
    plain = generate_jobs(N, jobs_per_hour=12.0, seed=7, table=SYNTHETIC)
    assert {j.priority_weight for j in plain} == {1.0} and {j.slo for j in plain} == {None}
    # Each draw has its own stream: turning priorities and SLOs on changes nothing else.
    same = [(j.job_type, j.scale_factor, j.total_steps, j.arrival_s) for j in plain]
    assert same == [(j.job_type, j.scale_factor, j.total_steps, j.arrival_s) for j in many]


def test_deterministic_by_seed(tmp_path: Path) -> None:
    a = generate_jobs(300, jobs_per_hour=30.0, seed=3, slos=True, table=SYNTHETIC)
    assert a == generate_jobs(300, jobs_per_hour=30.0, seed=3, slos=True, table=SYNTHETIC)
    assert a != generate_jobs(300, jobs_per_hour=30.0, seed=4, slos=True, table=SYNTHETIC)
    write_trace(a, tmp_path / "t.txt")  # a generated trace round-trips, less the durations it does not store
    assert [j.total_steps for j in read_trace(tmp_path / "t.txt", table=SYNTHETIC)] == [j.total_steps for j in a]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="jobs_per_hour is -1: give a rate >= 0"):
        generate_jobs(3, jobs_per_hour=-1, table=SYNTHETIC)
    with pytest.raises(ValueError, match="count is -1: give a number of jobs >= 0"):
        generate_jobs(-1, jobs_per_hour=1, table=SYNTHETIC)
    single = ThroughputTable.from_dict({"v100": {"('A3C', 1)": {"null": 1.0}}}, source="single.json")
    with pytest.raises(
        ValueError, match=r"no job type of single.json runs on [248] devices of v100: .*multi_gpu=False"
    ):
        generate_jobs(100, jobs_per_hour=1, table=single)
    with pytest.raises(ValueError, match=r"reference device type 'k80' is not in single.json \(\['v100'\]\)"):
        generate_jobs(1, jobs_per_hour=1, table=single, reference="k80")
    assert generate_jobs(0, jobs_per_hour=1, table=single) == []


def test_with_gavels_table() -> None:
    if not GAVEL.is_file():
        pytest.skip(f"Gavel's throughput table not found at {GAVEL} (only CI and developer machines have ../shared)")
    table = ThroughputTable.load(GAVEL)
    jobs = generate_jobs(2000, jobs_per_hour=6.0, seed=0, table=table)
    assert {j.job_type for j in jobs} == set(GAVEL_JOB_TYPES) == set(table.job_types)
    assert all(distributed(j.job_type) for j in jobs if j.scale_factor > 1)
    for j in jobs[:50]:
        assert j.total_steps == int((j.duration_s or 0) * table.alone(j.job_type, j.scale_factor, "v100"))
