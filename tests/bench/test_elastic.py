"""bench elastic reads its runs' logs right: the time from each fault to the next step after the generation
that answered it, the steps redone, and committed steps lost."""

import json
from pathlib import Path

from conveyor.bench.elastic import ElasticBenchConfig, _conveyor_events, _faults, _goals, committed_steps_lost


def write(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_fault_plan_follows_the_phases() -> None:
    spec, phases = _faults(ElasticBenchConfig(workers=4, revoke=2, grace=5), train_s=100.0)
    assert phases == [("revoke", False, 10.0), ("add", False, 20.0), ("revoke", True, 60.0), ("add", True, 72.0)]
    assert "revoke:worker=2,at=10.0;revoke:worker=3,at=10.0" in spec and "revoke:worker=3,at=60.0,grace=5" in spec


def test_events_are_read_from_the_logs(tmp_path: Path) -> None:
    write(
        tmp_path / "faults.jsonl",
        [
            {"event": "begin", "kind": "revoke", "at": 1.0, "wall": 100.0},
            {"event": "killed", "kind": "revoke", "at": 1.0, "wall": 100.0},
            {"event": "begin", "kind": "add", "at": 2.0, "wall": 110.0},
        ],
    )
    write(
        tmp_path / "elastic.jsonl",
        [
            {"event": "decided", "gen": 1, "reason": "lost [3]", "wall": 100.5},
            {"event": "decided", "gen": 2, "reason": "lost [4]", "wall": 100.6},  # answered in one recovery
            {"event": "generation", "gen": 2, "wall": 100.7, "steps_redone": 3, "resume_step": 8, "committed": 8},
            {"event": "resumed", "gen": 2, "wall": 100.9},
            {"event": "decided", "gen": 3, "reason": "joined [6]", "wall": 118.0},
            {"event": "generation", "gen": 3, "wall": 118.2, "steps_redone": 0, "resume_step": 40, "committed": 40},
            {"event": "resumed", "gen": 3, "wall": 118.5},
        ],
    )
    events = _conveyor_events(tmp_path, [("revoke", False, 1.0), ("add", False, 2.0)], [3, 4])
    assert [(e["kind"], e["recovery_s"], e["steps_redone"]) for e in events] == [("revoke", 0.9, 3), ("add", 8.5, 0)]
    late = _conveyor_events(tmp_path, [("revoke", True, 9.0)], [3, 4])  # a fault the run ended before
    assert late[0]["recovery_s"] is None and late[0]["missed"] == "the run ended first"
    assert committed_steps_lost(tmp_path) == 0
    write(
        tmp_path / "elastic.jsonl",
        [{"event": "generation", "gen": 1, "wall": 1.0, "steps_redone": 9, "resume_step": 5, "committed": 8}],
    )
    assert committed_steps_lost(tmp_path) == 3  # resumed before a committed step: caught


def test_goals_compare_each_revocation_with_torchrun() -> None:
    def ev(kind: str, s: float) -> dict:
        return {"kind": kind, "recovery_s": s, "steps_redone": 0}

    report = {
        "uninterrupted": {"final_accuracy": 0.95},
        "conveyor": {
            "events": [ev("revoke", 1.0), ev("add", 9.0), ev("revoke", 0.5)],
            "committed_steps_lost": 0,
            "final_accuracy": 0.945,
        },
        "torchrun": {"events": [ev("revoke", 12.0), ev("add", 0.0), ev("revoke", 2.0)]},
    }
    goals = _goals(report)
    assert goals["worst_recovery_s"] == 1.0 and goals["recovery_met"] and goals["phases_missed"] == []
    assert goals["min_speedup_vs_torchrun"] == 4.0 and not goals["speedup_met"]
    assert goals["accuracy_points_below_uninterrupted"] == 0.5 and goals["accuracy_met"]
