"""Fault plans for an emulated cluster: turn a user's fault spec into a time-ordered list of ``Fault`` events.

Spec items are separated by ``;`` (or newlines). Each is a JSON file of fault dicts (``*.json``), one scripted
event ``KIND:key=value,...``, or a seeded pattern: ``rotating-slow``, ``disrupted`` and ``power-law`` after
FlexRR's straggler patterns (Harlap et al., "Addressing the straggler problem for iterative convergent parallel
ML", SoCC 2016), ``random-revoke`` (spot revocations as a Poisson process) and ``trace`` (a spot-availability
trace, in the formats of ``../shared/spot-traces``). Everything here is pure: nothing is applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.emulate._traces import replay_trace
from conveyor.errors import InputError

__all__ = ["KINDS", "PATTERNS", "Fault", "parse_faults"]

KINDS = ("slow", "pause", "load", "revoke", "add", "link-down")
PATTERNS = ("rotating-slow", "disrupted", "power-law", "random-revoke", "trace")

# The keys each item accepts, and an example of it that error messages show.
_KEYS: dict[str, tuple[str, str]] = {
    "slow": ("at for worker server cores", "slow:worker=1,at=2,for=3,cores=0.25"),
    "pause": ("at for worker server", "pause:worker=1,at=2,for=3"),
    "load": ("at for worker server", "load:server=0,at=2,for=3"),
    "revoke": ("at worker server grace", "revoke:server=1,at=10,grace=30"),
    "add": ("at worker server", "add:worker=3,at=60"),
    "link-down": ("at for server", "link-down:server=0,at=5,for=2"),
    "rotating-slow": ("factor period seed cores among at until", "rotating-slow:factor=0.5,period=10,seed=1"),
    "disrupted": ("server worker at for seed period among until", "disrupted:server=1,at=5,for=20"),
    "power-law": ("alpha scale period seed among at until", "power-law:alpha=1.5,scale=0.1,period=10,seed=1"),
    "random-revoke": ("rate grace seed server at until", "random-revoke:rate=0.01,grace=30,seed=1"),
    "trace": (
        "time-scale offset machines first grace",
        "trace:../shared/spot-traces/p3-trace.csv,time-scale=3600,machines=4,first=1",
    ),
}
# Kinds whose events last a while; a revoke or an add is an instant.
_LASTING = ("slow", "pause", "load", "link-down")


@dataclass(frozen=True)
class Fault:
    """One fault event. Fields other than ``at``, ``kind`` and ``source`` apply to some kinds only.

    Example:
        >>> Fault(2.0, "slow", (1,), duration=3.0, cores=0.25).to_dict()["workers"]
        [1]
    """

    at: float  # seconds after the job's workers start
    kind: str  # one of KINDS
    workers: tuple[int, ...] = ()  # the ranks affected, sorted (every kind but link-down)
    duration: float = 0.0  # slow, pause, load, link-down: how long it lasts (0: until the job ends)
    cores: float = 0.0  # slow: the CPU cores each affected worker keeps meanwhile (> 0)
    grace: float = 0.0  # revoke: seconds from the notice (SIGTERM) to the SIGKILL
    server: int = -1  # link-down: the server (level-0 group) whose link to the rest fails
    source: str = ""  # the spec item that produced it

    def __post_init__(self) -> None:
        # Check here, so that every way of making a Fault (spec, JSON, code) refuses the same nonsense.
        if self.kind not in KINDS:
            raise InputError(f"unknown fault kind {self.kind!r}: use one of {', '.join(KINDS)}")
        for name in ("at", "duration", "cores", "grace"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InputError(f"{self.kind} fault: {name}={value!r} must be a finite number >= 0")
            object.__setattr__(self, name, round(float(value), 6))  # microseconds: clean logs, exact round trips
        if any(type(w) is not int or w < 0 for w in self.workers) or type(self.server) is not int:
            raise InputError(f"{self.kind} fault: workers {list(self.workers)} and server {self.server!r} must be ints")
        object.__setattr__(self, "workers", tuple(sorted(set(self.workers))))
        if self.kind == "link-down" and (self.workers or self.server < 0):
            raise InputError("link-down fault: give server=S (>= 0) and no workers, e.g. link-down:server=0,at=5,for=2")
        if self.kind != "link-down" and (not self.workers or self.server != -1):
            raise InputError(f"{self.kind} fault: give the ranks in workers (no server), e.g. {_KEYS[self.kind][1]}")
        if (self.kind == "slow") != (self.cores > 0):
            problem = "needs cores > 0" if self.kind == "slow" else "takes no cores (only slow faults do)"
            raise InputError(f"{self.kind} fault: {problem}, e.g. {_KEYS['slow'][1]}")
        if self.grace and self.kind != "revoke":
            raise InputError(f"{self.kind} fault: grace goes with revoke faults only, e.g. {_KEYS['revoke'][1]}")
        if self.duration and self.kind not in _LASTING:
            raise InputError(f"{self.kind} fault: an instant event has no duration; drop it")

    def to_dict(self) -> dict[str, Any]:
        """This event as a JSON-ready dict (every field; ``workers`` a list), as the run's fault log keeps it."""
        d = dataclasses.asdict(self)
        d["workers"] = list(self.workers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fault:
        """The event a dict describes (as ``to_dict`` writes it; only ``at`` and ``kind`` are required).

        Raises:
            ValueError: On unknown keys, a missing ``at`` or ``kind``, an unknown kind or a bad value.

        Example:
            >>> Fault.from_dict({"at": 5, "kind": "link-down", "server": 0, "duration": 2}).server
            0
        """
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict):
            raise InputError(f"a fault must be a JSON object with keys among {', '.join(fields)}, not {d!r}")
        unknown = sorted(set(d) - set(fields))
        if unknown or "at" not in d or "kind" not in d:
            problem = f"unknown keys {unknown}" if unknown else "missing 'at' or 'kind'"
            raise InputError(f"fault {d!r}: {problem}; keys are {', '.join(fields)} (at and kind required)")
        workers = d.get("workers", [])
        if not isinstance(workers, list | tuple):
            raise InputError(f"fault {d!r}: workers must be a list of ranks, e.g. [0, 1]")
        return cls(**{**d, "workers": tuple(workers)})


def _sort_key(f: Fault) -> tuple[float, int, tuple[int, ...], int]:
    # Kinds order as in KINDS, so a machine's revoke comes before the add that refills its slot at that instant.
    return (f.at, KINDS.index(f.kind), f.workers, f.server)


def parse_faults(text: str, workers: int, per_server: int = 1, horizon_s: float = 3600.0) -> list[Fault]:
    """The fault events a spec describes, sorted by (at, kind in ``KINDS`` order, workers).

    Args:
        text: The spec: items separated by ``;`` or newlines (see the module docstring and ``_KEYS``).
        workers: The job's worker count (ranks ``0 .. workers-1``).
        per_server: Workers per server (the topology's innermost count); server S holds ranks
            ``S*per_server .. S*per_server+per_server-1`` (the last server may hold fewer).
        horizon_s: Patterns generate events up to here (unless ``until=``); later events are dropped.

    Returns:
        The events, earliest first; ``[]`` for an empty spec.

    Raises:
        ValueError: A one-line message naming the bad item, what is wrong and how to write it.

    Example:
        >>> [(f.at, f.kind, f.workers) for f in parse_faults("revoke:server=1,at=10,grace=30; slow:worker=0,at=2,"
        ...                                                   "for=3,cores=0.5", workers=4, per_server=2)]
        [(2.0, 'slow', (0,)), (10.0, 'revoke', (2, 3))]
    """
    if workers < 1 or per_server < 1 or not horizon_s >= 0:
        raise InputError(
            f"parse_faults needs workers, per_server >= 1 and horizon_s >= 0, not {workers}, {per_server}, {horizon_s}"
        )
    events: list[Fault] = []
    for raw in text.replace("\n", ";").split(";"):
        item = raw.strip()
        if not item:
            continue
        head, _, rest = item.partition(":")
        spec = _Item(item, head.strip(), workers, per_server, horizon_s)
        if spec.head in KINDS:
            events.append(spec.scripted(rest))
        elif spec.head in PATTERNS:
            events += getattr(spec, spec.head.replace("-", "_"))(rest)
        elif item.endswith(".json"):
            events += _json_faults(item, workers, per_server)
        else:
            raise InputError(
                f"fault spec item {item!r}: unknown kind or pattern {spec.head!r}; an item is a .json file, "
                f"KIND:key=value,... with KIND one of {', '.join(KINDS)}, or a pattern: {', '.join(PATTERNS)}"
            )
    return sorted((f for f in events if f.at <= horizon_s), key=_sort_key)


def _json_faults(path: str, workers: int, per_server: int) -> list[Fault]:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"fault file {path!r} not found: give an existing .json file holding a list of fault dicts")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"fault file {path!r} is not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, list):
        raise InputError(
            f'fault file {path!r} must hold a list of fault dicts: [{{"at": 2, "kind": "pause", "workers": [1]}}]'
        )
    out = []
    for d in data:
        f = Fault.from_dict(d)
        if (f.workers and f.workers[-1] >= workers) or f.server >= -(-workers // per_server):
            raise InputError(f"fault file {path!r}: {d!r} names a rank or server beyond this job's {workers} workers")
        out.append(f if f.source else dataclasses.replace(f, source=f"json:{file.name}"))
    return out


class _Item:
    """One spec item being parsed: its keys, and the events each kind of item makes of them."""

    def __init__(self, item: str, head: str, workers: int, per_server: int, horizon_s: float) -> None:
        self.item, self.head, self.n, self.per_server, self.horizon = item, head, workers, per_server, horizon_s
        self.servers = -(-workers // per_server)
        self.kv: dict[str, str] = {}

    def fail(self, problem: str) -> InputError:
        return InputError(f"fault spec item {self.item!r}: {problem}; write it like {_KEYS[self.head][1]!r}")

    def parse(self, rest: str, positional: bool = False) -> str:
        """Fill ``self.kv`` from ``key=value,...``; with ``positional``, return the leading value without a key."""
        allowed, first = _KEYS[self.head][0].split(), ""
        for i, part in enumerate(p.strip() for p in rest.split(",")):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not part:
                continue
            if positional and i == 0 and not eq:
                first = part
            elif not eq or not key or not value:
                raise self.fail(f"{part!r} is not key=value")
            elif key not in allowed:
                raise self.fail(f"unknown key {key!r} (keys: {', '.join(sorted(allowed))})")
            elif key in self.kv:
                raise self.fail(f"key {key!r} given twice")
            else:
                self.kv[key] = value
        return first

    def num(self, key: str, default: float | None = None, positive: bool = False) -> float:
        if key not in self.kv:
            if default is None:
                raise self.fail(f"missing {key}=")
            return default
        try:
            value = float(self.kv[key])
        except ValueError:
            raise self.fail(f"{key}={self.kv[key]!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise self.fail(f"{key}={self.kv[key]} must be {'> 0' if positive else '>= 0'}")
        return value

    def whole(self, key: str, default: int | None = None, below: int | None = None) -> int:
        value = self.num(key, None if default is None else float(default))
        if value != int(value):
            raise self.fail(f"{key}={self.kv[key]} must be a whole number")
        if below is not None and value >= below:
            raise self.fail(f"{key}={self.kv[key]} is out of range: this job's {key}s are 0..{below - 1}")
        return int(value)

    def ranks(self, server: int) -> tuple[int, ...]:
        return tuple(range(server * self.per_server, min((server + 1) * self.per_server, self.n)))

    def target(self) -> tuple[int, ...]:
        """The ranks named by ``worker=R`` or ``server=S`` (exactly one of them)."""
        if ("worker" in self.kv) == ("server" in self.kv):
            raise self.fail("give exactly one of worker=R or server=S")
        if "worker" in self.kv:
            return (self.whole("worker", below=self.n),)
        return self.ranks(self.whole("server", below=self.servers))

    def pool(self) -> int:
        """How many workers a pattern draws from: the first ``among=K`` (default all of them)."""
        k = self.whole("among", self.n)
        if not 1 <= k <= self.n:
            raise self.fail(f"among={k} must be 1 to this job's {self.n} workers")
        return k

    def span(self) -> tuple[float, float]:
        """Where a pattern generates events: from ``at`` (default 0) to ``until`` (default the horizon)."""
        return self.num("at", 0.0), self.num("until", self.horizon)

    def make(self, at: float, kind: str, ranks: tuple[int, ...], **fields: Any) -> Fault:
        return Fault(at, kind, ranks, source=self.head, **fields)

    def scripted(self, rest: str) -> Fault:
        self.parse(rest)
        if self.head == "link-down":
            server = self.whole("server", below=self.servers)
            return Fault(self.num("at", 0.0), "link-down", (), self.num("for", 0.0), server=server, source=self.item)
        fields: dict[str, Any] = {"duration": self.num("for", 0.0)} if self.head in _LASTING else {}
        if self.head == "slow":
            fields["cores"] = self.num("cores", positive=True)
        if self.head == "revoke":
            fields["grace"] = self.num("grace", 0.0)
        return Fault(self.num("at", 0.0), self.head, self.target(), source=self.item, **fields)

    def rotating_slow(self, rest: str) -> list[Fault]:
        """FlexRR's slow-worker pattern: each period one worker, never the previous one, runs at ``factor`` speed.

        ``cores=`` is the worker's normal CPU cores (default 1), so the slowed one keeps ``factor * cores``.
        Each event lasts exactly one period: at any time exactly one worker is slow. ``among=K`` draws from the
        first ``K`` workers only (a pipeline's replicated first stage).
        """
        self.parse(rest)
        factor, period = self.num("factor", positive=True), self.num("period", positive=True)
        if factor >= 1:
            raise self.fail(f"factor={factor} must be below 1 (the slowed worker's fraction of its speed)")
        cores, (t, until), n = self.num("cores", 1.0, positive=True), self.span(), self.pool()
        rng, out, prev = np.random.default_rng(self.whole("seed", 0)), list[Fault](), -1
        while t < until:
            if prev < 0 or n == 1:
                prev = int(rng.integers(n))
            else:
                # Draw among the other n-1 workers, skipping over the previous one: each other equally likely.
                w = int(rng.integers(n - 1))
                prev = w + 1 if w >= prev else w
            out.append(self.make(t, "slow", (prev,), duration=period, cores=factor * cores))
            t += period
        return out

    def disrupted(self, rest: str) -> list[Fault]:
        """FlexRR's disrupted-machine pattern: a competing CPU load beside every worker of a server for ``for`` s.

        ``at=``: one disruption of ``server=`` (or ``worker=``). ``seed=`` and ``period=`` instead: one per period
        at a random moment within it (so none overlap), on a random server unless ``server=``/``worker=`` is given
        (``among=K``: a server of the first ``K`` workers).
        """
        self.parse(rest)
        duration = self.num("for", positive=True)
        if ("at" in self.kv) == ("seed" in self.kv):
            raise self.fail("give at=T for one disruption or seed=S with period=P for random ones (not both)")
        if "at" in self.kv:
            return [self.make(self.num("at"), "load", self.target(), duration=duration)]
        period, (t, until) = self.num("period", positive=True), self.span()
        fixed = self.target() if "worker" in self.kv or "server" in self.kv else None
        rng, out = np.random.default_rng(self.whole("seed")), list[Fault]()
        while t < until:
            start = t + rng.uniform(0.0, max(period - duration, 0.0))
            ranks = fixed or self.ranks(int(rng.integers(-(-self.pool() // self.per_server))))
            out += [self.make(start, "load", ranks, duration=duration)] if start < until else []
            t += period
        return out

    def power_law(self, rest: str) -> list[Fault]:
        """FlexRR's power-law pattern, as pauses with power-law (Pareto) durations.

        Every period each worker pauses, independently, for ``scale * (L + 1)`` seconds, ``L`` a Lomax(``alpha``)
        draw, i.e. a Pareto duration with minimum ``scale`` and tail ``P(D > x) = (scale / x) ** alpha``, capped
        at the period, from a uniformly random moment of the period such that the pause ends within it (so a
        worker's pauses never overlap, and the workers' are not aligned). (The paper's own definition of this
        pattern could not be retrieved; this is the stated fallback.) ``among=K``: only the first ``K`` workers.
        """
        self.parse(rest)
        alpha, scale = self.num("alpha", positive=True), self.num("scale", positive=True)
        period, (t, until) = self.num("period", positive=True), self.span()
        if scale >= period:
            raise self.fail(f"scale={scale} must be below period={period} (pauses are capped at the period)")
        rng, out = np.random.default_rng(self.whole("seed", 0)), list[Fault]()
        while t < until:
            for w, draw in enumerate(rng.pareto(alpha, self.pool())):
                duration = min(scale * (float(draw) + 1.0), period)
                start = t + float(rng.uniform(0.0, period - duration))
                out.append(self.make(start, "pause", (w,), duration=duration))
            t += period
        return out

    def random_revoke(self, rest: str) -> list[Fault]:
        """Spot revocations as a Poisson process of ``rate`` per second (for the whole job) of random live workers.

        With ``server=1`` each revocation takes a whole random live server. A revoked rank is never revoked
        again; the process stops when none is left.
        """
        self.parse(rest)
        rate, grace, (t, until) = self.num("rate", positive=True), self.num("grace", 0.0), self.span()
        if self.kv.get("server", "0") not in ("0", "1"):
            raise self.fail("server= is a flag: server=1 revokes whole servers, server=0 (the default) single ranks")
        whole = self.kv.get("server") == "1"
        live = [self.ranks(s) for s in range(self.servers)] if whole else [(w,) for w in range(self.n)]
        rng, out = np.random.default_rng(self.whole("seed", 0)), list[Fault]()
        while live:
            t += float(rng.exponential(1.0 / rate))
            if t >= until:
                break
            out.append(self.make(t, "revoke", live.pop(int(rng.integers(len(live)))), grace=grace))
        return out

    def trace(self, rest: str) -> list[Fault]:
        """Revocations and additions that replay a spot-availability trace onto worker slots (ranks).

        Machines map to slots as :func:`replay_trace` says. Job time ``(t - offset) / time-scale`` for trace time ``t``
        (seconds from the trace's first line): the fleet live at ``offset`` is the one the job starts on (no
        events); a later removal revokes its slot's rank (with ``grace``), a later addition emits ``add``.
        Slots the trace has no machine for at the start are revoked at time 0 with no grace. The trace governs
        slots ``0 .. M-1``, M the ``machines=`` key or else its peak live count (an error if above the
        worker count); slot ``s`` is rank ``first + s`` (``first=`` key, default 0: a job's reliable workers
        come first and the trace governs the transient ones); other ranks get no events.
        """
        file = Path(path := self.parse(rest, positional=True))
        if not path or not file.is_file():
            raise self.fail(f"trace file {path!r} not found" if path else "missing the trace file's path")
        scale, offset = self.num("time-scale", 1.0, positive=True), self.num("offset", 0.0)
        grace = self.num("grace", 0.0)
        steps = replay_trace(file)
        peak = max((slot + 1 for _, _, slot in steps), default=0)
        first = self.whole("first", 0, below=self.n)
        room = self.n - first
        if "machines" in self.kv:
            keep = self.whole("machines")
            if not 1 <= keep <= room:
                raise self.fail(f"machines={keep} must be 1..{room} (the job's workers from rank {first})")
        elif peak > room:
            raise InputError(
                f"trace {file.name}: up to {peak} machines are live at once but the job has {room} workers from "
                f"rank {first}; add machines=M (M <= {room}) to keep only the first M machine slots"
            )
        else:
            keep = peak
        live, out, source = set[int](), list[Fault](), f"trace:{file.name}"
        for t, op, slot in steps:
            if slot >= keep:
                continue  # a slot beyond the job's: its machine's events are dropped
            if t <= offset:
                # Up to the offset the trace only builds the fleet the job starts on.
                (live.add if op == "add" else live.discard)(slot)
            elif op == "add":
                out.append(Fault((t - offset) / scale, "add", (first + slot,), source=source))
            else:
                out.append(Fault((t - offset) / scale, "revoke", (first + slot,), grace=grace, source=source))
        # Slots the trace has no machine for at the start are revoked at once (no notice: there was no machine).
        return [Fault(0.0, "revoke", (first + s,), source=source) for s in range(keep) if s not in live] + out
