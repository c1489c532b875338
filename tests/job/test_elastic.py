"""conveyor train --reliable: bad options fail in one line, and a run on the emulated cluster trains through a
revocation and an addition and writes its run folder."""

import json
import time
from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.config import TrainConfig
from conveyor.emulate import Emulation
from conveyor.job import join_elastic, read_jsonl, train_elastic, write_lease
from conveyor.job._elastic import check_faults

pytestmark = pytest.mark.timeout(180)


def test_options_that_cannot_go_with_elastic_training_fail_in_one_line() -> None:
    with pytest.raises(ValueError, match="drop --stragglers"):
        TrainConfig.from_options(reliable=1, stragglers="flexrr")
    with pytest.raises(ValueError, match="--reliable 5: give 1 to 4"):
        check_faults(Emulation(), 5, 4)
    with pytest.raises(ValueError, match="revokes worker 0, which is reliable"):
        check_faults(Emulation(faults="revoke:worker=0,at=3"), 1, 4)
    check_faults(Emulation(faults="revoke:worker=3,at=3"), 1, 4)  # a transient one is fine
    with pytest.raises(ValueError, match="give HOST:PORT"):
        join_elastic("nowhere")
    with pytest.raises(ValueError, match="--elastic-layout 'stages': use data or pipeline"):
        TrainConfig.from_options(reliable=1, elastic_layout="stages")


@pytest.mark.slow
def test_an_elastic_pipeline_plans_from_worker_0s_profile(tmp_path: Path) -> None:
    summary = train_elastic(
        TrainConfig.from_options(reliable=1, workers=3, epochs=2, run_dir=str(tmp_path), elastic_layout="pipeline")
    )
    (start,) = summary.generations
    assert sum(start["layout"]["replicas"]) == len(start["compute"]) and summary.epochs == 2


@needs_root
def test_a_run_survives_a_revocation_and_takes_a_worker_in(tmp_path: Path) -> None:
    faults = "revoke:worker=2,at=0.3;add:worker=2,at=0.6"
    # 60 epochs, so the run goes on long after the addition: on a busy machine a joiner took 4 s to start, and more
    # to be let in (40 epochs ended first)
    cfg = TrainConfig.from_options(
        reliable=1, workers=3, epochs=60, run_dir=str(tmp_path), faults=faults, resources_every=1.0
    )
    summary = train_elastic(cfg)
    assert summary.epochs == 60 and summary.accuracy[-1] > 0.9
    reasons = [g["reason"] for g in summary.generations]
    assert reasons[0] == "start" and "lost [2]" in reasons and any("joined" in r for r in reasons)
    for name in ("metrics.jsonl", "elastic.jsonl", "checkpoint.pt", "summary.json", "accuracy.png", "faults.jsonl"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "summary.json").read_text())["generations"] == summary.generations
    samples = [json.loads(line) for line in (tmp_path / "resources.jsonl").read_text().splitlines()]
    assert {0, 1} <= {s["worker"] for s in samples}, samples


@pytest.mark.slow
def test_an_elastic_job_stops_before_its_lease_ends(tmp_path: Path) -> None:
    lease = tmp_path / "lease.json"
    until = time.time() + 10  # the workers take a few seconds to start; then epochs of a fraction of a second
    write_lease(lease, until)
    cfg = TrainConfig.from_options(
        reliable=1, workers=2, epochs=100_000, run_dir=str(tmp_path / "run"), lease=str(lease)
    )
    summary = train_elastic(cfg)
    assert 1 <= summary.epochs < 100_000 and time.time() < until + 15  # stopped by the lease, not the epochs
    assert (tmp_path / "run" / "checkpoint.pt").exists()


@needs_root
def test_a_worker_paused_past_the_loss_limit_learns_it_was_declared_lost(tmp_path: Path) -> None:
    # Frozen for 4 s against a 2 s limit: the others go on without it; thawed, it says so and exits.
    cfg = TrainConfig.from_options(
        reliable=1, workers=3, epochs=80, run_dir=str(tmp_path), faults="pause:worker=2,at=1,for=4", lost_s=2.0
    )
    summary = train_elastic(cfg)
    assert summary.epochs == 80 and "lost [2]" in [g["reason"] for g in summary.generations]
    told = [e for e in read_jsonl(tmp_path / "elastic.jsonl") if e["event"] == "declared lost"]
    assert [e["worker"] for e in told] == [2]
    # Its record shows the stall: a gap of the pause between beats (or, not yet beaten since, the last long ago).
    assert max([*told[0]["longest_gaps_s"], told[0]["last_beat_ago_s"]]) > 3.0 and told[0]["error"] is None
    (decided,) = [
        e for e in read_jsonl(tmp_path / "elastic.jsonl") if e["event"] == "decided" and e["reason"] == "lost [2]"
    ]
    assert decided["silent_s"]["2"] >= 2.0 and decided["evidence"] is False  # silence alone: nothing failed
    assert decided["closed"] == {}  # and its connection open: it was alive


@needs_root
def test_a_killed_worker_is_known_by_its_closed_connection_while_a_stalled_one_is_waited_for(tmp_path: Path) -> None:
    # Worker 3 is killed while worker 2 is frozen for 3 s. Its connection to worker 0 closes: it is lost within a
    # second, though no collective can fail until worker 2 thaws (heartbeats alone took 2.6 s here); worker 2,
    # connected, gets the 10 s limit. (The rule that spares a stalled worker when a collective has failed is
    # tested on the coordinator alone, in tests/elastic/test_membership.py.)
    faults = "pause:worker=2,at=1,for=3;revoke:worker=3,at=1.5"
    cfg = TrainConfig.from_options(reliable=1, workers=4, epochs=80, run_dir=str(tmp_path), faults=faults)
    summary = train_elastic(cfg)
    assert summary.epochs == 80 and [g["reason"] for g in summary.generations] == ["start", "lost [3]"]
    events = read_jsonl(tmp_path / "elastic.jsonl")
    assert not [e for e in events if e["event"] == "declared lost"]
    (decided,) = [e for e in events if e["event"] == "decided" and e["reason"] == "lost [3]"]
    assert list(decided["closed"]) == ["3"] and decided["silent_s"]["3"] < 1.0, decided
