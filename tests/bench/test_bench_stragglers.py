"""``conveyor bench stragglers``: capacity from a fault log, and a small run end to end (root only)."""

import json

import pytest
from emulation import needs_root

from conveyor.bench.stragglers import StragglersConfig, mean_capacity, run


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


@needs_root
@pytest.mark.timeout(300)
def test_a_small_run_reports_every_pattern_and_mode(tmp_path) -> None:
    cfg = StragglersConfig(model="mlp", epochs=1, batch_size=64, period=1.0, patterns=("slow-worker", "none"),
                           modes=("flexrr",))  # fmt: skip
    report = run(cfg, str(tmp_path / "ratios.png"), keep=str(tmp_path / "runs"))
    assert [(r["pattern"], r["mode"]) for r in report["results"]] == [("slow-worker", "flexrr"), ("none", "flexrr")]
    slow, calm = report["results"]
    assert calm["mean_capacity_cores"] == pytest.approx(4 * 0.45)
    assert slow["mean_capacity_cores"] == pytest.approx(4 * 0.45 - 0.45 * (1 - 0.333), rel=0.05)  # one always slow
    assert calm["ratio_to_ideal"] == pytest.approx(1.0)  # the fastest no-jitter run is its own ideal
    assert slow["samples_moved"] > 0  # the fast replicas took the slow one's work
    steps = [json.loads(line) for line in (tmp_path / "runs/slow-worker-flexrr/stragglers.jsonl").open()]
    assert {s["replica"] for s in steps} == {0, 1, 2, 3} and sum(s["samples"] for s in steps) == 1437  # one epoch
    assert (tmp_path / "ratios.png").stat().st_size > 0
    assert set(report["goals"]) >= {"flexrr_met", "off_met", "worst_accuracy_points_below_no_jitter"}
