"""conveyor bench overhead: one worker of conveyor train and a plain loop on the same job, side by side."""

import json
import os

import pytest

from conveyor.bench import overhead
from conveyor.bench.overhead import Case, OverheadBenchConfig, plot, run

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_report_sets_each_run_beside_the_plain_loop(tmp_path) -> None:
    cases = {"cpu": {"mlp": Case("mlp", epochs=2)}, "cuda": {}}
    report = run(OverheadBenchConfig(models=("mlp",), gpu_models=(), contended=False, repeats=1, cases=cases))
    (result,) = report["results"]
    assert (result["model"], result["device"], result["contended"]) == ("mlp", "cpu", False)
    cores = len(os.sched_getaffinity(0))
    assert set(result["plain_runs"]) == ({"1", str(cores)} if cores > 1 else {"None"})
    assert result["plain_samples_per_s"] == max(runs[0] for runs in result["plain_runs"].values())
    assert result["conveyor_samples_per_s"] == result["conveyor_runs"][0] > 0
    assert result["ratio"] == pytest.approx(result["conveyor_samples_per_s"] / result["plain_samples_per_s"])
    assert len(result["paired_epoch_ratios"]) == 1 and result["paired_ratio"] == result["paired_epoch_ratios"][0] > 0
    (chose,) = result["conveyor_threads"]  # the worker's own count: one the plain loop ran at, on two cores or more
    if str(chose) in result["plain_runs"]:
        plain_there = result["plain_runs"][str(chose)][0]
        assert result["same_threads_ratio"] == pytest.approx(result["conveyor_samples_per_s"] / plain_there)
    else:
        assert result["same_threads_ratio"] is None and result["same_threads_ratios"] == [None]
    predicted = result["predicted_samples_per_s"]
    assert result["prediction_error"] == pytest.approx(result["conveyor_samples_per_s"] / predicted - 1)
    assert report["goals"]["ratio_met"] == (result["ratio"] >= 0.9) and report["goals"]["gpu_prediction_met"] is None
    json.dumps(report)
    plot(report["results"], tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_config_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown gpu models \['vgg19'\]"):
        OverheadBenchConfig(gpu_models=("vgg19",))
    with pytest.raises(ValueError, match="epochs at least 2"):
        OverheadBenchConfig(epochs=1)
    with pytest.raises(ValueError, match="case mlp: epochs at least 2"):
        Case("mlp", epochs=1)


def test_each_plain_run_has_a_process_of_its_own_and_neither_thread_count_always_runs_first(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int | None] = []
    speeds = {1: 100.0, 2: 120.0}  # two threads the faster: the paired processes run there
    monkeypatch.setattr(
        overhead, "_plain", lambda case, device, threads, profile: calls.append(threads) or speeds[threads]
    )
    monkeypatch.setattr(overhead, "_conveyor", lambda case, device, folder, profile: (90.0, 95.0, 1))
    paired: list[int | None] = []
    monkeypatch.setattr(overhead, "_paired", lambda case, device, threads: paired.append(threads) or [0.9, 1.0, 0.95])
    monkeypatch.setattr(overhead.os, "sched_getaffinity", lambda pid: {0, 1})
    cfg = OverheadBenchConfig(models=("mlp",), gpu_models=(), contended=False, repeats=3)
    result = overhead._measure(Case("mlp"), "cpu", False, cfg, tmp_path)
    assert calls == [1, 2, 2, 1, 1, 2]  # one call (one process) per thread count, the order turning each repeat
    assert result["plain_runs"] == {"1": [100.0] * 3, "2": [120.0] * 3} and result["ratio"] == 0.75
    assert paired == [2, 2, 2] and result["paired_ratio"] == 0.95  # a paired process a repeat, at the best count
    assert result["paired_threads"] == [2, 2, 2] and result["plain_threads"] == 2
    assert result["conveyor_threads"] == [1, 1, 1]
    assert result["same_threads_ratios"] == [0.9] * 3  # against the plain loop at the one thread Conveyor chose


def test_paired_process_alternates_which_loop_runs_first(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    shuffled: list[int] = []  # the epoch each Conveyor epoch's batches were ordered for
    monkeypatch.setattr(overhead._Job, "plain_epoch", lambda self, epoch: order.append("plain") or 2.0)
    monkeypatch.setattr(
        overhead.Alone, "run", lambda self, batches: order.append("ours") or shuffled.append(batches.order.epoch)
    )
    plain, ours = overhead._paired_worker(Case("mlp", epochs=3), threads=None)
    assert order == ["plain", "ours", "ours", "plain", "plain", "ours"] and shuffled == [0, 1, 2]
    assert plain == [2.0] * 3 and len(ours) == 3 and all(s >= 0 for s in ours)
