"""``conveyor bench stragglers``: capacity from a fault log, its cases, and a small run end to end (root only)."""

import json

import pytest
from emulation import needs_root

import conveyor.bench.stragglers as stragglers
from conveyor.bench._stragglers_report import goals as report_goals
from conveyor.bench.stragglers import StragglersConfig, mean_capacity, run
from conveyor.runtime import WorkerError


def _fault(kind: str, workers: list[int], begin: float, end: float | None, **extra: float) -> list[dict]:
    fault = {"kind": kind, "workers": workers, "at": begin, **extra}
    out = [{"event": "begin", "wall": begin, **fault}]
    return out + ([{"event": "end", "wall": end, **fault}] if end is not None else [])


def test_capacity_counts_each_fault_over_the_window_only() -> None:
    events = [
        *_fault("pause", [0], 0.0, 2.0),  # half of it before the window
        *_fault("load", [2, 3], 4.0, 6.0),  # two workers at half their cores
        *_fault("slow", [1], 8.0, None, cores=0.1),  # never ended: lasts to the window's end
        {"event": "begin", "wall": 5.0, "kind": "add", "workers": [3], "at": 5.0},  # not a loss of capacity
    ]
    cores, workers, start, end = 0.5, 4, 1.0, 9.0
    lost = 1 * 0.5 + 2 * 2 * 0.25 + 1 * (0.5 - 0.1)
    assert mean_capacity(events, cores, workers, start, end) == pytest.approx(2.0 - lost / 8.0)
    assert mean_capacity([], cores, workers, start, end) == 2.0


def test_a_failed_run_is_reported_and_the_others_still_run(monkeypatch, tmp_path) -> None:
    def fake_run(cfg, case, pattern, mode, folder):  # no processes: the report's arithmetic alone
        repeat = int(str(folder).rsplit("-", 1)[1])
        if (case.layout, pattern, mode, repeat) == ("4", "slow-worker", "off", 1):
            raise WorkerError(1, "RuntimeError", "timed out", "Traceback ...")
        seconds = {"none": 10.0, "slow-worker": 15.0}[pattern] * (1.2 if mode == "off" else 1.0) + repeat - 1
        capacity = {"none": 1.8, "slow-worker": 1.5}[pattern]
        return {
            "model": case.model,
            "layout": case.layout,
            "batch_size": case.batch_size,
            "pattern": pattern,
            "mode": mode,
            "seconds": seconds,
            "final_accuracy": 0.9,
            "chunks": 2,
            "samples_moved": 0,
            "samples_backed_up": 0,
            "samples_dropped": 0,
            "wait_s": None,
            "mean_capacity_cores": capacity,
            "workers": case.workers,
        }

    monkeypatch.setattr(stragglers, "_run_one", fake_run)
    cfg = StragglersConfig(cases=("mlp:4",), patterns=("slow-worker", "none"), modes=("flexrr", "off"), repeats=2)
    report = stragglers.run(cfg, keep=str(tmp_path))
    error = "worker 1 failed with RuntimeError: timed out"
    failed = {"model": "mlp", "layout": "4", "pattern": "slow-worker", "mode": "off", "repeat": 1, "error": error}
    assert report["failed"] == [failed]
    slow = report["results"][0]
    assert slow["runs"] == [15.0, 16.0] and slow["seconds"] == 15.5 and slow["spread"] == pytest.approx(1 / 15.5)
    # the ideal: flexrr's median no-jitter seconds (10.5, the fastest mode's) over the capacity left
    assert slow["ideal_seconds"] == pytest.approx(10.5 * 1.8 / 1.5)
    assert slow["ratios"] == pytest.approx([15 / 12.6, 16 / 12.6]) and slow["ratio_to_ideal"] == pytest.approx(
        15.5 / 12.6
    )
    goals = report["goals"]
    off_slow = next(r for r in report["results"] if (r["pattern"], r["mode"]) == ("slow-worker", "off"))
    assert off_slow["runs"] == [19.0]  # its first run failed; the second counts
    assert goals["best_mode"] == {"mlp:4/slow-worker": {"mode": "flexrr", "ratio_to_ideal": pytest.approx(15.5 / 12.6)}}
    assert goals["met"] == {"flexrr": False, "off": False}  # 1.23x on a slow worker
    assert goals["no_jitter_spread"] == {"mlp:4/flexrr": pytest.approx(1 / 10.5), "mlp:4/off": pytest.approx(1 / 12.5)}
    assert goals["no_jitter_spread_met"] is False
    assert report["config"]["default_mode"] == "off"


def _result(pattern: str, mode: str, ratio: float, accuracy: float) -> dict[str, object]:
    return {
        "model": "m",
        "layout": "4",
        "pattern": pattern,
        "mode": mode,
        "ratio_to_ideal": ratio,
        "spread": 0.02,
        "accuracy_points_below_no_jitter": 100 * (0.9 - accuracy),
    }


def test_a_mode_meets_the_goals_within_each_patterns_ratio_and_a_point_of_accuracy() -> None:
    results = [
        _result("slow-worker", "backup", 1.09, 0.9),
        _result("power-law", "backup", 1.24, 0.895),  # power-law's goal is 1.25x
        _result("none", "backup", 1.0, 0.9),
        _result("slow-worker", "flexrr", 1.05, 0.9),
        _result("power-law", "flexrr", 1.2, 0.88),  # fast, but 2 points less accurate
        _result("none", "flexrr", 1.0, 0.9),
        _result("slow-worker", "off", 1.5, 0.9),
        _result("power-law", "off", 1.6, 0.9),
        _result("none", "off", 1.0, 0.9),
    ]
    goals = report_goals(results)
    assert goals["met"] == {"backup": True, "flexrr": False, "off": False}
    assert goals["best_mode"] == {
        "m:4/slow-worker": {"mode": "flexrr", "ratio_to_ideal": 1.05},
        "m:4/power-law": {"mode": "flexrr", "ratio_to_ideal": 1.2},
    }
    assert goals["off_met"] is True  # the slow worker slowed the synchronous mode at least 1.4x
    assert goals["worst_accuracy_points_below_no_jitter"] == pytest.approx(2.0)
    assert goals["no_jitter_spread_met"] is True  # every mode's no-jitter runs within 2%


@pytest.mark.parametrize(
    ("cases", "match"),
    [
        (("resnet",), "not model:replicas"),
        (("resnet:4:x",), "not model:replicas"),
        (("vgg:1-2",), "replicate the first stage alone"),
        (("vgg:x",), "not a list of counts"),
    ],
)
def test_bad_cases_say_what_is_wrong(cases: tuple[str, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StragglersConfig(cases=cases)


@pytest.mark.parametrize("given", [True, False])
def test_the_runs_take_the_stale_correction_and_shares_given(given: bool, tmp_path) -> None:
    cfg = StragglersConfig(stale_correction=given, equal_shares=given)
    case = stragglers.Case.parse("vgg:2-1:64", cfg.batch_size)
    train = stragglers._train_config(cfg, case, "none", "flexrr", tmp_path)
    assert train.optimizer.stale_correction is given
    assert train.stragglers is not None and train.stragglers.equal_shares is given


@needs_root
@pytest.mark.timeout(300)
def test_a_small_run_reports_every_pattern_and_mode(tmp_path) -> None:
    # A pipeline case only (data parallelism is the one-stage case of the same trainer, tested in
    # tests/stragglers), to keep the suite short.
    cfg = StragglersConfig(
        cases=("mlp:2-1:32",),
        epochs=1,
        batch_size=64,
        period=1.0,
        patterns=("slow-worker", "none"),
        modes=("live", "ddp"),
        repeats=1,
    )
    report = run(cfg, str(tmp_path / "ratios.png"), keep=str(tmp_path / "runs"))
    runs = [(r["layout"], r["pattern"], r["mode"]) for r in report["results"]]
    assert runs == [("2-1", p, "live") for p in ("slow-worker", "none")]  # ddp: data parallelism only
    slow_pipe, calm_pipe = report["results"]
    # Only the pipeline's replicas are slowed (one of the two at any time), and they share the work.
    assert calm_pipe["mean_capacity_cores"] == [pytest.approx(3 * 0.45)]
    assert slow_pipe["mean_capacity_cores"] == [pytest.approx(3 * 0.45 - 0.45 * (1 - 0.333), rel=0.05)]
    assert calm_pipe["ratio_to_ideal"] == pytest.approx(1.0)  # the fastest no-jitter run is its own ideal
    assert slow_pipe["samples_moved"] > 0  # the fast replica took the slow one's work
    faults = [json.loads(line) for line in (tmp_path / "runs/mlp-2-1-slow-worker-live-1/faults.jsonl").open()]
    assert {w for f in faults if f.get("kind") == "slow" for w in f["workers"]} <= {0, 1}
    steps = [json.loads(line) for line in (tmp_path / "runs/mlp-2-1-slow-worker-live-1/stragglers.jsonl").open()]
    assert {s["replica"] for s in steps if s["stage"] == 0} == {0, 1}
    assert sum(s["samples"] for s in steps if s["stage"] == 1) == 1437  # one epoch, every sample once
    assert (tmp_path / "ratios.png").stat().st_size > 0
    assert slow_pipe["samples_dropped"] >= slow_pipe["samples_backed_up"] >= 0  # each used backup dropped a run
    assert set(report["goals"]) >= {"met", "best_mode", "off_met", "worst_accuracy_points_below_no_jitter"}
    assert report["failed"] == []


@needs_root
@pytest.mark.timeout(300)
def test_ddp_runs_on_the_same_emulated_devices_and_faults(tmp_path) -> None:
    cfg = StragglersConfig(
        cases=("mlp:2:32",), epochs=1, batch_size=64, patterns=("slow-worker", "none"), modes=("ddp",), repeats=1
    )
    report = run(cfg, keep=str(tmp_path / "runs"))
    slow, calm = report["results"]
    assert (slow["mode"], slow["pattern"], calm["pattern"]) == ("ddp", "slow-worker", "none")
    assert slow["mean_capacity_cores"][0] < calm["mean_capacity_cores"][0] == pytest.approx(2 * 0.45)
    assert slow["final_accuracy"] > 0.1 and slow["samples_moved"] == 0 and slow["wait_s"] is None
