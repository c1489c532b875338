"""bench soak: its membership pattern, its reading of losses and growth from the logs, its report, and a short
real soak of both jobs on the emulated cluster."""

import json
import re
from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.bench.soak import (
    SERIES,
    SoakConfig,
    _growths,
    ends,
    false_losses,
    growth,
    judge,
    membership_changes,
    plot,
    run,
)
from conveyor.errors import InputError


def write(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.parametrize("seed", range(5))
def test_membership_changes_are_always_possible(seed: int) -> None:
    spec = membership_changes(4, 5.0, 15.0, seed)
    items = re.findall(r"(revoke|add):worker=(\d+),at=([\d.]+)", spec)
    assert len(items) == 19 and [float(at) for *_, at in items] == [15.0 * i for i in range(1, 20)]
    present = {1, 2, 3}
    for kind, worker, _ in items:
        assert (int(worker) in present) == (kind == "revoke"), (
            spec
        )  # never revokes an absent one nor adds a present one
        present ^= {int(worker)}
    assert (
        spec == membership_changes(4, 5.0, 15.0, seed)
        and len({membership_changes(4, 5.0, 15.0, s) for s in range(5)}) > 1
    )


def test_false_losses_are_the_live_workers_told_they_were_lost(tmp_path: Path) -> None:
    write(
        tmp_path / "elastic.jsonl",
        [
            {"event": "decided", "gen": 1, "reason": "lost [2]", "wall": 102.0},  # revoked: it never speaks again
            {"event": "decided", "gen": 2, "reason": "lost [1]", "wall": 120.0},
            {"event": "declared lost", "worker": 1, "gen": 2, "wall": 120.3},  # alive: a false loss
        ],
    )
    assert false_losses(tmp_path) == 1


def test_growth_tells_a_leak_from_a_swing_and_a_spike() -> None:
    steady = [(float(t), 100.0 + (t // 10) % 3) for t in range(0, 1200, 10)]  # swings between 100 and 102
    spike = [(float(t), 14.0 + 6 * (t == 1180)) for t in range(0, 1200, 10)]  # one sample of 20 at the end
    leak = [(float(t), 100.0 + t / 60) for t in range(0, 1200, 10)]  # one per minute
    often = [(float(t), 14.0 + 3 * (t % 60 == 0)) for t in range(0, 1200, 10)]  # 17 a moment every minute
    assert ends(steady, warm_s=120, end_s=1190) == ((102.0, 102.0), (100.0, 100.0)) and growth(102.0, 102.0) == 0.0
    assert ends(spike, warm_s=120, end_s=1190) == ((14.0, 14.0), (14.0, 14.0))
    assert ends(often, warm_s=120, end_s=1190) == ((17.0, 17.0), (14.0, 14.0))  # a peak, but a flat floor
    (first, last), floor = ends(leak, warm_s=120, end_s=1190) or ((0.0, 0.0), (0.0, 0.0))
    assert (first, last) == (100 + 220 / 60, 100 + 1180 / 60)  # each window's second-highest
    assert floor == (100 + 130 / 60, 100 + 1080 / 60)  # and second-lowest: a leak raises both
    assert growth(first, last) == pytest.approx(last / first - 1, abs=1e-4) and growth(first, last) > 0.15
    assert ends([(0.0, 5.0), (130.0, 5.0)], warm_s=120, end_s=1190) is None  # too few samples after the warm-up
    assert growth(0.0, 3.0) is None  # nothing to grow from


def _kept_soak(root: Path, *, elastic_error: str | None = None) -> None:
    """The folders a soak of both jobs keeps: two processes each, one of them leaking descriptors."""
    for job, pid in (("data-parallel", 10), ("elastic", 20)):
        run = root / job / "run"
        run.mkdir(parents=True)
        samples = [
            {"worker": w, "pid": pid + w, "wall": 1000.0 + t, "rss_bytes": 2e8, "threads": 5, "store_keys": 9}
            | {"fds": 14 + (t // 60 if (job, w) == ("elastic", 1) else 0)}
            for t in range(0, 600, 10)
            for w in (0, 1)
        ]
        write(run / "resources.jsonl", samples)
        (run / "summary.json").write_text(json.dumps({"seconds": 599.0, "epochs": 40, "accuracy": [0.5, 0.98]}))
    write(root / "elastic" / "run" / "elastic.jsonl", [{"event": "generation", "committed": 5, "resume_step": 5}])
    if elastic_error:
        (root / "elastic" / "error.txt").write_text(elastic_error)


def test_a_kept_soak_is_judged_from_its_folders(tmp_path: Path) -> None:
    _kept_soak(tmp_path)
    report = judge(SoakConfig(minutes=10, warmup=2), tmp_path)
    assert [(r["job"], r["epochs"], r["final_accuracy"], r["error"]) for r in report["runs"]] == [
        ("data-parallel", 40, 0.98, None),
        ("elastic", 40, 0.98, None),
    ]
    assert report["committed_steps_lost"] == 0 and report["false_losses"] == 0
    over = [(g["job"], g["worker"], g["series"]) for g in report["growth"] if g["growth"] >= 0.05]
    assert over == [("elastic", 1, "fds")] and not report["goals"]["met"]
    assert {s["t_s"] for s in report["series"]} == {float(t) for t in range(0, 600, 10)}


def test_a_failed_job_is_reported_and_a_folder_without_samples_refused(tmp_path: Path) -> None:
    _kept_soak(tmp_path / "a", elastic_error="worker 2 failed: RuntimeError: boom")
    report = judge(SoakConfig(minutes=10, warmup=2, jobs=("elastic",)), tmp_path / "a")
    assert report["runs"][0]["error"] == "worker 2 failed: RuntimeError: boom" and not report["goals"]["met"]
    with pytest.raises(InputError, match=r"holds no resources\.jsonl: give the --keep folder of a soak"):
        judge(SoakConfig(), tmp_path / "nothing")


def test_only_processes_that_live_through_are_judged() -> None:
    def sample(pid: int, t: float, worker: int) -> dict:
        return {
            "job": "elastic",
            "worker": worker,
            "pid": pid,
            "t_s": t,
            **dict.fromkeys(SERIES, 10),
            "store_keys": None,
        }

    series = [sample(1, t, 0) for t in range(0, 300, 10)] + [sample(2, t, 1) for t in range(150, 300, 10)]
    growths = _growths(SoakConfig(minutes=5, jobs=("elastic",), warmup=1), series)
    assert {(g["pid"], g["series"]) for g in growths} == {(1, "rss_bytes"), (1, "fds"), (1, "threads")}


def test_bad_options_fail_in_one_line() -> None:
    for bad, match in [
        ({"minutes": 2, "warmup": 2}, "must exceed --warmup"),
        ({"jobs": ("dp",)}, "dp"),
        ({"workers": 1}, "--workers is at least 2"),
        ({"stragglers": "off"}, "--stragglers 'off'"),
    ]:
        with pytest.raises(InputError, match=match):
            SoakConfig(**bad)


def test_the_plot_is_written(tmp_path: Path) -> None:
    series = [
        {"job": job, "worker": 0, "pid": pid, "t_s": t, "rss_bytes": 1e8, "fds": 9, "threads": 4, "store_keys": 7}
        for job, pid in (("data-parallel", 1), ("elastic", 2))
        for t in range(0, 300, 10)
    ]
    report = {"config": {"warmup": 2.0}, "series": series, "growth": [{"job": "elastic", "pid": 2}]}
    plot(report, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000


@needs_root
@pytest.mark.timeout(300)
def test_a_short_soak_of_both_jobs(tmp_path: Path) -> None:
    cfg = SoakConfig(minutes=0.3, warmup=0.1, every=1.0, workers=2, change_every=5.0, busy=1)
    report = run(cfg, str(tmp_path / "soak.png"), str(tmp_path / "runs"))
    assert [r["job"] for r in report["runs"]] == ["data-parallel", "elastic"]
    assert all(r["error"] is None and r["epochs"] >= 1 and r["seconds"] < 60 for r in report["runs"]), report["runs"]
    assert report["committed_steps_lost"] == 0 and report["false_losses"] == 0
    jobs = {(s["job"], s["worker"]) for s in report["series"]}
    assert {("data-parallel", 0), ("data-parallel", 1), ("elastic", 0)} <= jobs
    assert {(g["job"], g["worker"]) for g in report["growth"]} >= {("data-parallel", 0), ("elastic", 0)}
    faults = [json.loads(x) for x in (tmp_path / "runs" / "elastic" / "run" / "faults.jsonl").read_text().splitlines()]
    assert any(f.get("kind") == "revoke" for f in faults) and (tmp_path / "soak.png").exists()
