"""The recurrence store: the search's order through begin/finish, settings checks, concurrent jobs, dead ones."""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.synchronize
from pathlib import Path

import pytest

from conveyor.energy import BatchSizeSearch, JobSettings, Recurrence, RecurrenceStore, default_store_path
from conveyor.processes import worker_context  # forked from a server that imported torch: no import each

SETTINGS = JobSettings((16, 32, 64), default=32, target=0.9, eta=0.5, beta=2.0)


def test_recurrences_follow_the_search(tmp_path: Path) -> None:
    store = RecurrenceStore(tmp_path / "r.sqlite")
    costs = {16: 50.0, 32: 40.0, 64: 30.0}
    sizes = []
    for _ in range(7):
        started = store.begin("job", SETTINGS)
        sizes.append(started.batch_size)
        store.finish(started.id, cost=costs[started.batch_size], energy_j=1.0, time_s=1.0, reached=True, epochs=3)
    # Pruning: 32, 16, then 64; round two from the cheapest (64): 64, then down 32, 16; then Thompson sampling
    # over three sizes with equal rewards each: 64, the cheapest.
    assert sizes == [32, 16, 64, 64, 32, 16, 64]
    history = store.history("job")
    assert history[:3] == [Recurrence(32, 40.0, True), Recurrence(16, 50.0, True), Recurrence(64, 30.0, True)]
    search = BatchSizeSearch(SETTINGS.sizes, SETTINGS.default, beta=SETTINGS.beta)
    assert store.begin("job", SETTINGS).stop_above == search.stop_above(history) == 60.0
    assert [r["state"] for r in store.rows("job")][-1] == "running"


def test_settings_must_match_and_the_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RecurrenceStore(tmp_path / "r.sqlite")
    store.begin("job", SETTINGS)
    other = JobSettings((16, 32, 64), default=32, target=0.95, eta=0.5, beta=2.0)
    with pytest.raises(ValueError, match=r"job 'job' was recorded with target 0\.9 \(now 0\.95\): give the same"):
        store.begin("job", other)
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path / "data"))
    assert default_store_path() == tmp_path / "data" / "recurrences.sqlite"


def test_failed_runs_prune_and_other_settings_are_refused(tmp_path: Path) -> None:
    store = RecurrenceStore(tmp_path / "r.sqlite")
    first = store.begin("job", SETTINGS)
    store.finish(first.id, cost=40.0, energy_j=None, time_s=1.0, reached=True, epochs=3)
    second = store.begin("job", SETTINGS)
    assert second.batch_size == 16
    store.abandon(second.id, failed=True)  # e.g. out of memory: 16 counts as missing the target
    failed = store.history("job")[-1]
    assert (failed.batch_size, failed.reached, math.isnan(failed.cost)) == (16, False, True)
    assert store.begin("job", SETTINGS).batch_size == 64  # down ended at 16: up from 32
    other = JobSettings(SETTINGS.sizes, 32, 0.9, 0.5, 2.0, context='{"model": "vgg"}')
    with pytest.raises(ValueError, match=r"recorded with context  \(now \{\"model\": \"vgg\"\}\)"):
        store.begin("job", other)


def _begin_and_hold(path: str, ready: mp.synchronize.Barrier, done: mp.synchronize.Event, out: mp.Queue) -> None:
    ready.wait()
    started = RecurrenceStore(Path(path)).begin("job", SETTINGS)
    out.put((started.id, started.batch_size, started.phase))
    done.wait(60)  # stay alive (running) until every process has begun


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_beginnings_take_turns_and_only_one_explores(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite")
    RecurrenceStore(Path(path))
    ctx = worker_context()
    ready, done, out = ctx.Barrier(4), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_begin_and_hold, args=(path, ready, done, out)) for _ in range(4)]
    try:
        for p in procs:
            p.start()
        results = [out.get(timeout=90) for _ in procs]
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert len({r[0] for r in results}) == 4  # four rows, none lost to a lock
    assert sorted(r[2] for r in results) == ["best", "best", "best", "explore"]
    assert all(r[1] == 32 for r in results)  # the explorer takes b0; the others the best known (b0 too)


def _begin_and_die(path: str) -> None:
    RecurrenceStore(Path(path)).begin("job", SETTINGS)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_recurrence_whose_process_died_is_abandoned(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    p = worker_context().Process(target=_begin_and_die, args=(str(path),))
    p.start()
    p.join(50)
    store = RecurrenceStore(path)
    started = store.begin("job", SETTINGS)
    assert started.phase == "explore" and started.batch_size == 32  # not "best": nobody else is running
    assert [r["state"] for r in store.rows("job")] == ["abandoned", "running"]
