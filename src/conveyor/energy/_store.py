"""The recurrences of named jobs, in a local SQLite file that concurrent jobs share safely.

Each ``conveyor train --batch-size auto --job NAME`` run is one recurrence: it begins (the store replays the
job's finished recurrences through :class:`BatchSizeSearch` to choose its batch size, and records it as
running, in one write transaction) and finishes (its cost, energy, time and whether it reached the target).
SQLite's write lock serialises concurrent beginnings; a recurrence that begins while another of the same job
is still exploring takes the best size known instead (so exploration stays sequential, as Zeus requires).
A recurrence whose process died without finishing (same host, process gone) is marked abandoned; one that
failed with an error counts as not reaching the target (so a size that runs out of memory is pruned, not
tried again and again). The store is for one machine's jobs: SQLite's locking is not reliable on network
file systems.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from conveyor.energy._bandit import BatchSizeSearch, Recurrence
from conveyor.errors import InputError
from conveyor.paths import data_dir
from conveyor.processes import process_alive

__all__ = ["JobSettings", "RecurrenceStore", "Started", "default_store_path"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (name TEXT PRIMARY KEY, settings TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS recurrences (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL REFERENCES jobs(name), batch_size INTEGER NOT NULL,
    phase TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, started REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'running',  -- running, finished, failed (an error), abandoned (interrupted)
    finished REAL, cost REAL, energy_j REAL, time_s REAL, reached INTEGER, epochs INTEGER
);
"""


def default_store_path() -> Path:
    """``$CONVEYOR_DATA/recurrences.sqlite``, else the user's data directory (``~/.local/share/conveyor``)."""
    return data_dir() / "recurrences.sqlite"


@dataclass(frozen=True)
class JobSettings:
    """What a job's recurrences must share for their costs to be comparable (``context``: the rest of the
    run's settings that change its cost, e.g. model, optimizer, workers, as text)."""

    sizes: tuple[int, ...]
    default: int
    target: float
    eta: float
    beta: float
    context: str = ""


@dataclass(frozen=True)
class Started:
    """A recurrence that began: its id, batch size, why that size, and its early-stopping cost."""

    id: int
    batch_size: int
    phase: str
    stop_above: float
    number: int  # how many recurrences of the job began before it


class RecurrenceStore:
    """The store at ``path`` (default :func:`default_store_path`).

    Example:
        >>> import tempfile
        >>> store = RecurrenceStore(Path(tempfile.mkdtemp()) / "r.sqlite")
        >>> settings = JobSettings((32, 64, 128), default=64, target=0.9, eta=0.5, beta=2.0)
        >>> first = store.begin("nightly", settings)
        >>> first.batch_size, first.phase
        (64, 'explore')
        >>> store.finish(first.id, cost=100.0, energy_j=80.0, time_s=1.0, reached=True, epochs=5)
        >>> store.begin("nightly", settings).batch_size  # then down from the default
        32
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_store_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            db.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=60.0, isolation_level=None)

    def begin(self, job: str, settings: JobSettings) -> Started:
        """Choose the next recurrence's batch size and record it as running (one write transaction)."""
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")  # the write lock: concurrent beginnings take turns
            row = db.execute("SELECT settings FROM jobs WHERE name = ?", (job,)).fetchone()
            if row is None:
                db.execute("INSERT INTO jobs VALUES (?, ?)", (job, json.dumps(asdict(settings))))
            elif (
                old := JobSettings(**{**json.loads(row[0]), "sizes": tuple(json.loads(row[0])["sizes"])})
            ) != settings:
                raise InputError(
                    f"job {job!r} was recorded with {_differences(old, settings)}: give the same, or a new --job name"
                )
            self._abandon_dead(db, job)
            history = _history(db, job)
            search = BatchSizeSearch(settings.sizes, settings.default, beta=settings.beta)
            number = db.execute("SELECT COUNT(*) FROM recurrences WHERE job = ?", (job,)).fetchone()[0]
            running = db.execute(
                "SELECT COUNT(*) FROM recurrences WHERE job = ? AND state = 'running'", (job,)
            ).fetchone()[0]
            choice = search.choose(history, np.random.default_rng(number))
            size, phase = choice.batch_size, choice.phase
            if running and phase == "explore":
                size, phase = search.best(history), "best"
            cursor = db.execute(
                "INSERT INTO recurrences (job, batch_size, phase, host, pid, started) VALUES (?, ?, ?, ?, ?, ?)",
                (job, size, phase, socket.gethostname(), os.getpid(), time.time()),
            )
            db.execute("COMMIT")
            assert cursor.lastrowid is not None
            return Started(cursor.lastrowid, size, phase, search.stop_above(history), number)
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def finish(
        self, id: int, *, cost: float, energy_j: float | None, time_s: float, reached: bool, epochs: int
    ) -> None:
        """Record recurrence ``id``'s outcome."""
        with self._connect() as db:
            db.execute(
                "UPDATE recurrences SET state = 'finished', finished = ?, cost = ?, energy_j = ?, time_s = ?, "
                "reached = ?, epochs = ? WHERE id = ?",
                (time.time(), cost, energy_j, time_s, int(reached), epochs, id),
            )

    def abandon(self, id: int, *, failed: bool = False) -> None:
        """Mark recurrence ``id`` as ended without an outcome: ``failed`` (an error: the search counts it as not
        reaching the target) or abandoned (interrupted: it teaches the search nothing)."""
        with self._connect() as db:
            db.execute(
                "UPDATE recurrences SET state = ?, finished = ? WHERE id = ? AND state = 'running'",
                ("failed" if failed else "abandoned", time.time(), id),
            )

    def history(self, job: str) -> list[Recurrence]:
        """The job's finished recurrences, in the order they finished."""
        with self._connect() as db:
            return _history(db, job)

    def rows(self, job: str) -> list[dict[str, object]]:
        """Every recurrence of ``job`` as a dict (for listing)."""
        with self._connect() as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM recurrences WHERE job = ? ORDER BY id", (job,))]

    @staticmethod
    def _abandon_dead(db: sqlite3.Connection, job: str) -> None:
        here = socket.gethostname()
        for id, pid in db.execute(
            "SELECT id, pid FROM recurrences WHERE job = ? AND state = 'running' AND host = ?", (job, here)
        ).fetchall():
            if not process_alive(pid):
                db.execute("UPDATE recurrences SET state = 'abandoned' WHERE id = ?", (id,))


def _history(db: sqlite3.Connection, job: str) -> list[Recurrence]:
    rows = db.execute(
        "SELECT batch_size, cost, reached, phase FROM recurrences WHERE job = ? AND state IN "
        "('finished', 'failed') ORDER BY finished, id",
        (job,),
    ).fetchall()
    return [Recurrence(int(b), math.nan if c is None else float(c), bool(r), p == "explore") for b, c, r, p in rows]


def _settings(text: str) -> JobSettings:
    fields = json.loads(text)
    return JobSettings(**{**fields, "sizes": tuple(fields["sizes"])})


def _differences(old: JobSettings, new: JobSettings) -> str:
    return ", ".join(
        f"{k} {getattr(old, k)} (now {getattr(new, k)})" for k in asdict(old) if getattr(old, k) != getattr(new, k)
    )
