"""Membership through the c10d store: heartbeats, notices, joins, and generations the coordinator decides.

The store lives on the first reliable worker (id 0), which also runs the :class:`Coordinator`, a thread
that watches every worker's heartbeat (a counter each worker's :class:`Heartbeat` thread adds to every
``beat_s``), the revocation notices (``leave/ID``) and the join requests, and on any change writes the next
**generation**: who is a member, who is leaving (it hands its state over, then exits), each worker's role
(:mod:`conveyor.elastic._tiers`), and whether the change is *planned* (notices and joins only: the members
switch at an agreed step boundary, nothing is redone) or a *failure* (a worker died: everybody drops the step
in flight at once). A worker is declared lost when its connection to worker 0 closes (its process died: see
:mod:`conveyor.elastic._liveness`), or when its heartbeat has not moved for ``lost_s`` (its host vanished, or it
stalled that long). Until its connection is up (the first moments after it starts), a worker's heartbeat still
for ``suspect_s`` (a few beats) is enough once a peer reported a failed collective (``suspects``): a killed
worker's ring neighbours' collectives fail at once and say so. That shortened limit is not applied to a
connected worker, whose death its connection tells: a live worker stalled on a busy machine beside a lost one
would be taken with it.

Store keys: ``gen`` (the latest generation number), ``gen/G`` (its record, JSON), ``boundary/G`` (a planned
generation's step, proposed by the first computing worker to see it), ``hb/ID``, ``leave/ID``, ``left/ID``,
``joins`` and ``join/N`` (join requests), ``alive/ID/`` (the rendezvous of a worker's pair with worker 0),
``next_id``, ``suspects`` (failed collectives), ``fatal`` (why the job must stop), ``pg/G/NAME/`` (the rendezvous
of generation ``G``'s gloo groups), and ``state_gen`` (the generation worker 0 last recovered in: a recovery reads
its record to find who holds the state). So that the store does not grow with the generations, the coordinator
deletes a join request once read, and a generation's record, boundary and groups' keys once it is
:data:`KEPT_GENERATIONS` generations old and older than ``state_gen``, with the keys of its workers gone since (ids
are never reused). A worker that far behind finds no record: a newer generation has replaced its own, and it
switches at once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from conveyor.elastic._tiers import BACKUP_ONLY_MIN, SYNC_MAX, Roles, roles

__all__ = [
    "ALL_GROUP",
    "KEPT_GENERATIONS",
    "NOTICE",
    "RECOVER_GROUP",
    "TRAIN_GROUP",
    "Connections",
    "Coordinator",
    "Generation",
    "Heartbeat",
    "JobFailed",
    "MembershipChanged",
    "connect",
    "group_prefix",
    "latest",
    "listen_for_notice",
    "liveness_prefix",
    "record",
    "rendezvous_keys",
    "stage_group",
]

# Set when this process got a revocation notice (SIGTERM, as a spot machine does); its heartbeat posts it.
NOTICE = threading.Event()
KEPT_GENERATIONS = 4  # generations whose keys the store keeps at least (see the module docstring)
_KEPT_BEATS = 100  # a heartbeat's last beats kept: 20 s of them at the default 0.2 s
# A generation's gloo groups, by name (the coordinator deletes their keys by these names): besides one per
# replicated stage (stage_group).
RECOVER_GROUP, TRAIN_GROUP, ALL_GROUP = "recover", "train", "all"


def stage_group(stage: int) -> str:
    """The name of the group of ``stage``'s replicas."""
    return f"stage{stage}"


def group_prefix(g: int, name: str) -> str:
    """Where generation ``g``'s group ``name`` meets in the store."""
    return f"pg/{g}/{name}/"


def liveness_prefix(worker: int) -> str:
    """Where worker ``worker``'s pair with the coordinator meets (:mod:`conveyor.elastic._liveness`)."""
    return f"alive/{worker}/"


def rendezvous_keys(prefix: str, ranks: int) -> list[str]:
    """Every key a gloo group of ``ranks`` built under ``prefix`` writes: its rendezvous puts each rank's address
    at ``0/RANK``, which torch's ``PrefixStore`` joins to the prefix with a ``/`` (as of torch 2.13)."""
    return [f"{prefix}/0/{rank}" for rank in range(ranks)]


def _group_keys(gen: Generation) -> list[str]:
    """Every key ``gen``'s groups can have written."""
    n = len(gen.participants)
    names = (RECOVER_GROUP, TRAIN_GROUP, ALL_GROUP, *(stage_group(k) for k in range(n)))
    return [key for name in names for key in rendezvous_keys(group_prefix(gen.gen, name), n)]


def listen_for_notice() -> None:
    """Treat SIGTERM as a revocation notice: post it (``leave/ID``) and work on until the SIGKILL."""

    def noticed(signum: int, frame: object) -> None:
        NOTICE.set()
        print("revocation notice (SIGTERM): handing over at the next step boundary", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, noticed)


class MembershipChanged(Exception):
    """A newer generation replaced this worker's: drop what is in flight and recover."""


class JobFailed(RuntimeError):
    """The job cannot go on (the reliable tier was lost, or the coordinator said so)."""


@dataclass(frozen=True)
class Generation:
    """One membership of the job, as the coordinator wrote it to ``gen/G``."""

    gen: int
    members: tuple[int, ...]  # who trains in it, sorted
    leaving: tuple[int, ...]  # who hands its state over and exits (revoked with notice)
    reliable: tuple[int, ...]
    roles: Roles
    planned: bool  # only notices and joins: switch at a step boundary, nothing in flight is dropped
    reason: str  # what changed, for the run folder's log

    @property
    def participants(self) -> tuple[int, ...]:
        """Everybody in the hand-over: the members and the leavers."""
        return tuple(sorted(self.members + self.leaving))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        d = json.loads(text)
        r = d["roles"]
        return cls(
            d["gen"],
            tuple(d["members"]),
            tuple(d["leaving"]),
            tuple(d["reliable"]),
            Roles(r["stage"], tuple(r["compute"]), tuple(r["owners"])),
            d["planned"],
            d["reason"],
        )


def connect(host: str, port: int, is_leader: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """A client of the job's store (the leader, id 0, hosts it: give ``port=0`` for any free port)."""
    # Signals wait until connected: one that interrupts the connection makes the client back off for seconds (seen
    # on a busy machine: a joiner came in after the job had ended).
    held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        # The server without libuv: the libuv one stopped accepting after about 24 clients in one process (2.13).
        return dist.TCPStore(
            host, port, None, is_leader, timeout=timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=False
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def record(store: dist.Store, g: int) -> Generation | None:
    """Generation ``g``'s record, or ``None`` once the coordinator has deleted it (never waits)."""
    key = f"gen/{g}"
    return Generation.from_json(store.get(key)) if store.check([key]) else None


def latest(store: dist.Store) -> Generation:
    """The newest generation, or :class:`JobFailed` when the coordinator has given up."""
    if store.check(["fatal"]):
        raise JobFailed(store.get("fatal").decode())
    g = store.add("gen", 0)
    return Generation.from_json(store.get(f"gen/{g}"))


class Heartbeat:
    """Adds 1 to ``hb/ID`` every ``beat_s`` seconds from a thread of its own (own store client), until closed,
    and posts this process's revocation notice (:data:`NOTICE`) once it has one."""

    def __init__(self, host: str, port: int, *, worker: int, beat_s: float) -> None:
        self._store = connect(host, port, is_leader=False)
        self._worker, self._beat_s = worker, beat_s
        self._stop = threading.Event()
        self._store.add(f"hb/{worker}", 1)
        self._beats = deque([time.monotonic()], maxlen=_KEPT_BEATS)  # when the last beats landed
        self.error: str | None = None  # why the beats stopped, if they did
        self._thread = threading.Thread(target=self._run, name="conveyor-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._beat_s):
            try:
                if NOTICE.is_set():
                    self._store.set(f"leave/{self._worker}", "1")
                self._store.add(f"hb/{self._worker}", 1)
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return
            self._beats.append(time.monotonic())

    def record(self) -> dict[str, object]:
        """What this process's beats looked like lately: the longest gaps between them (seconds), how long ago
        the last landed, and why they stopped if they did (for the record of a worker declared lost alive)."""
        beats = list(self._beats)  # (copied whole under the GIL: the thread appends meanwhile)
        gaps = sorted((b - a for a, b in itertools.pairwise(beats)), reverse=True)[:3]
        return {
            "longest_gaps_s": [round(g, 3) for g in gaps],
            "last_beat_ago_s": round(time.monotonic() - beats[-1], 3),
            "beating": self._thread.is_alive(),
            "error": self.error,
        }

    def close(self) -> None:
        self._stop.set()


@dataclass
class _Watch:
    count: int
    moved_at: float


class Connections(Protocol):
    """Each worker's connection to the coordinator's process, which closes when the worker's process dies
    (:class:`conveyor.elastic._liveness.Liveness`)."""

    def watch(self, worker: int) -> None:
        """Start connecting to ``worker``."""

    def paired(self, worker: int) -> bool:
        """Whether ``worker``'s connection is up."""

    def closed(self, worker: int) -> str | None:
        """Why ``worker``'s connection closed, or ``None`` while it is open or not up."""

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s connection (it was lost or has left)."""


class Coordinator:
    """The leader's thread that turns heartbeats, notices and joins into generations.

    Args:
        host, port: the store (this process hosts it).
        initial: the workers started with the job (ids ``0 .. n-1``); ``reliable`` are the first ``K``.
        lost_s: a heartbeat still this long means the worker is lost.
        beat_s: the heartbeats' period: ``suspect_s``, a few of them, is the limit for a worker not yet
            connected once a peer reported a failed collective (``suspects``).
        start_s: how long a worker may take to send its first heartbeat.
        sync_max, backup_only_min: AgileML's stage thresholds (:func:`conveyor.elastic._tiers.agile_stage`).
        log: where each decision is logged (``elastic.jsonl``), when it is wanted.
        liveness: each worker's connection to this process, which tells its death (without it, the
            heartbeats alone do).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        initial: int,
        reliable: int,
        lost_s: float = 10.0,
        beat_s: float = 0.2,
        start_s: float = 120.0,
        sync_max: float = SYNC_MAX,
        backup_only_min: float = BACKUP_ONLY_MIN,
        log: Path | None = None,
        liveness: Connections | None = None,
    ) -> None:
        self.store = connect(host, port, is_leader=False)
        self.log, self.liveness = log, liveness
        self.reliable = tuple(range(reliable))
        # After a failed collective, a few beats of silence are enough (never less than 0.6 s).
        self.lost_s, self.suspect_s, self.start_s = lost_s, max(3 * beat_s, 0.6), start_s
        self.sync_max, self.backup_only_min = sync_max, backup_only_min
        now = time.monotonic()
        self._watch = {w: _Watch(-1, now) for w in range(initial)}
        if liveness is not None:
            for w in range(1, initial):
                liveness.watch(w)
        self._leaving: set[int] = set()
        self._joins_seen = 0
        self._suspects, self._suspected_at = 0, -float("inf")
        self._ticked = time.monotonic()
        self._recent: deque[Generation] = deque()  # the generations whose keys are kept
        self.store.add("next_id", initial)  # a joiner's id is add("next_id", 1) - 1
        self.generation = self._write(tuple(range(initial)), (), planned=True, reason="start")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-coordinator", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _write(
        self, members: tuple[int, ...], leaving: tuple[int, ...], planned: bool, reason: str, **logged: object
    ) -> Generation:
        lost_reliable = [w for w in self.reliable if w not in members]
        if lost_reliable:
            message = (
                f"reliable worker {lost_reliable[0]} was lost: the reliable tier holds the job's store and "
                "backups and must outlive it; revoke only transient workers"
            )
            self.store.set("fatal", message)
            raise JobFailed(message)
        g = self.store.add("gen_counter", 1) - 1
        who = roles(members, self.reliable, None, self.sync_max, self.backup_only_min)
        gen = Generation(g, members, leaving, self.reliable, who, planned, reason)
        self.store.set(f"gen/{g}", gen.to_json())
        self.store.add("gen", 1 if g else 0)
        self._recent.append(gen)
        state_gen = int(self.store.get("state_gen")) if self.store.check(["state_gen"]) else -1
        while len(self._recent) > KEPT_GENERATIONS and self._recent[0].gen < state_gen:
            self._forget(self._recent.popleft(), gen)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "wall": round(time.time(), 4),
                            "event": "decided",
                            "gen": g,
                            "reason": reason,
                            "planned": planned,
                        }
                        | logged
                    )
                    + "\n"
                )
        return gen

    def _forget(self, old: Generation, newest: Generation) -> None:
        """Delete ``old``'s keys, and those of its participants gone since."""
        gone = [w for w in old.participants if w not in newest.participants and w not in self._watch]
        keys = [f"gen/{old.gen}", f"boundary/{old.gen}", *_group_keys(old)]
        keys += [f"{kind}/{w}" for w in gone for kind in ("hb", "leave", "left")]
        keys += [key for w in gone for key in rendezvous_keys(liveness_prefix(w), 2)]
        for key in keys:
            self.store.delete_key(key)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                if self.store.check(["finished"]):  # the run is over: exits are no losses
                    return
                self._tick()
            except JobFailed:
                return
            except Exception as exc:  # without a coordinator nobody could recover: stop the job
                with contextlib.suppress(Exception):  # (unless the store itself is gone with the job)
                    self.store.set("fatal", f"the coordinator on worker 0 failed: {type(exc).__name__}: {exc}")
                return

    def _heartbeats(self, now: float) -> tuple[dict[int, float], dict[int, str], list[int]]:
        """Who is lost (with how long each one's heartbeat had been still), whose connection closed of those
        (with gloo's word for it), and who has left."""
        suspects = self.store.add("suspects", 0)
        if suspects != self._suspects:  # a collective failed somewhere: a peer's connection closed
            self._suspects, self._suspected_at = suspects, now
        # After such evidence a heartbeat still for a few beats is enough; otherwise it takes lost_s.
        limit = min(self.lost_s, self.suspect_s) if now - self._suspected_at < self.lost_s else self.lost_s
        silent: dict[int, float] = {}
        closed: dict[int, str] = {}
        left: list[int] = []
        for w, watch in self._watch.items():
            if w == self.reliable[0]:  # this process: alive while it runs
                continue
            count = self.store.add(f"hb/{w}", 0)
            died = self.liveness.closed(w) if self.liveness is not None else None
            connected = self.liveness is not None and self.liveness.paired(w)
            if w in self._leaving and self.store.check([f"left/{w}"]):
                left.append(w)  # handed its state over and exited: not a loss
            elif died is not None:
                silent[w], closed[w] = round(now - watch.moved_at, 3), died
            elif count != watch.count:
                watch.count, watch.moved_at = count, now
            elif now - watch.moved_at > (self.lost_s if connected else limit if watch.count >= 0 else self.start_s):
                silent[w] = round(now - watch.moved_at, 3)  # (one not yet beating is starting: it gets start_s)
        return silent, closed, left

    def _tick(self) -> None:
        now = time.monotonic()
        stalled = now - self._ticked
        if stalled > self.suspect_s / 2:  # this process stalled: a silence is counted only while it ran
            for watch in self._watch.values():
                watch.moved_at += stalled
        self._ticked = now
        current = self.generation
        silent, closed, left = self._heartbeats(now)
        lost = list(silent)
        for w in lost + left:
            del self._watch[w]
            if self.liveness is not None:
                self.liveness.forget(w)
        self._leaving -= set(left)
        # A leaver listed again in a generation newer than the one it handed over in would be waited for in vain.
        relisted = [w for w in left if w in current.participants and int(self.store.get(f"left/{w}")) < current.gen]
        noticed = [  # a reliable worker is not revoked
            w
            for w in self._watch
            if w not in self._leaving and w not in self.reliable and self.store.check([f"leave/{w}"])
        ]
        self._leaving |= set(noticed)
        joined = []
        while self._joins_seen < self.store.add("joins", 0) and self.store.check([f"join/{self._joins_seen}"]):
            w = int(self.store.get(f"join/{self._joins_seen}"))
            self.store.delete_key(f"join/{self._joins_seen}")  # read once, here
            self._joins_seen += 1
            self._watch[w] = _Watch(-1, now)
            joined.append(w)
            if self.liveness is not None:
                self.liveness.watch(w)
        lost_participants = [w for w in lost if w in current.participants]
        if not (lost_participants or noticed or joined or relisted):
            return
        alive = set(self._watch)
        members = tuple(sorted(alive - self._leaving))
        leaving = tuple(sorted(alive & self._leaving))
        parts = [
            f"lost {lost_participants}" if lost_participants else "",
            f"notice {noticed}" if noticed else "",
            f"joined {joined}" if joined else "",
            f"left {relisted}" if relisted else "",
        ]
        # A loss is logged with each heartbeat's silence, each closed connection, and whether a failed collective
        # had just been reported (it shortens the limit for a worker not yet connected).
        why = {
            "silent_s": {w: silent[w] for w in lost_participants},
            "closed": {w: closed[w] for w in lost_participants if w in closed},
            "evidence": now - self._suspected_at < self.lost_s,
        }
        self.generation = self._write(
            members,
            leaving,
            planned=not lost_participants,
            reason=", ".join(p for p in parts if p),
            **(why if lost_participants else {}),
        )
