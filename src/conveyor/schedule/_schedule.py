"""Pipeline schedules as data: one ordered list of actions per worker.

A schedule says, for every worker, what to do and in which order: run the forward or backward of a
microbatch, send or receive an activation or a gradient, step the optimizer. The same lists feed the
validator (:mod:`conveyor.schedule._validate`), the simulator (:mod:`conveyor.schedule._simulate`) and the executor
(:mod:`conveyor.runtime._executor`), so what is checked and predicted is exactly what runs.

Example:
    >>> print(flush(stages=2, microbatches=2))
    flush: 2 stages, 2 microbatches
      worker 0 (stage 0): F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 RECV_B1<1 B1 STEP
      worker 1 (stage 1): RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 STEP
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

__all__ = [
    "ASYNCHRONOUS",
    "SCHEDULES",
    "Action",
    "Op",
    "Schedule",
    "flush",
    "forward_only",
    "gpipe",
    "make_schedule",
    "pipedream",
    "twobw",
    "twobw_min_microbatches",
]


class Op(StrEnum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"
    STEP = "STEP"

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACTIVATION, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACTIVATION, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of one worker's program.

    Attributes:
        op: what to do.
        microbatch: the microbatch it concerns (``None`` for an optimizer step).
        peer: for sends and receives, the worker on the other end.
        version: for a forward, the weight version it must use (the number of optimizer steps this
            worker had taken when that version was current); ``None`` means the newest. The backward
            of a microbatch always uses the version of its forward.
    """

    op: Op
    microbatch: int | None = None
    peer: int | None = None
    version: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        version = "" if self.version is None else f"@{self.version}"
        if self.peer is None:
            return f"{self.op.value}{mb}{version}"
        return f"{self.op.value}{mb}{'>' if self.op.is_send else '<'}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"SEND_F3>1"`` -> ``Action(Op.SEND_ACTIVATION, 3, 1)``, ``"F4@2"`` -> version 2."""
        for op in sorted(Op, key=lambda o: -len(o.value)):
            if text.startswith(op.value):
                rest, _, version = text[len(op.value) :].partition("@")
                mb, _, peer = rest.replace("<", ">").partition(">")
                return cls(op, int(mb) if mb else None, int(peer) if peer else None, int(version) if version else None)
        raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F0', 'F5@1', 'RECV_B2<1', 'STEP'")


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for one optimizer step (or one evaluation pass).

    Attributes:
        name: the generator that made it (``"gpipe"``, ``"flush"``, ...).
        stages: number of pipeline stages.
        microbatches: microbatches in the whole run (numbered from 0, in the order the data comes).
        worker_stage: the stage each worker runs: ``(0, 1, ..., stages-1)`` for one worker per stage,
            ``(0, 0, 1)`` for a stage 0 with two data-parallel replicas.
        actions: ``actions[w]`` is worker ``w``'s program, in order.
    """

    name: str
    stages: int
    microbatches: int
    worker_stage: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def workers(self) -> int:
        return len(self.worker_stage)

    @property
    def replicas(self) -> tuple[int, ...]:
        """Number of workers running each stage."""
        return tuple(self.worker_stage.count(s) for s in range(self.stages))

    def update_size(self, stage: int) -> int:
        """How many microbatches' gradients make one optimizer step of ``stage`` (over all its replicas)."""
        w = self.worker_stage.index(stage)
        backwards = 0
        for a in self.actions[w]:
            if a.op is Op.STEP:
                break
            backwards += a.op is Op.BACKWARD
        return backwards * self.replicas[stage]

    def forward_versions(self, worker: int) -> dict[int, int]:
        """The weight version each of ``worker``'s forwards uses (a ``None`` version resolved to the newest)."""
        return _forward_versions(self.actions[worker])

    def unmade_version(self, worker: int) -> int | None:
        """The index of ``worker``'s first forward that asks for a version not made yet, or ``None``."""
        steps = 0
        for i, a in enumerate(self.actions[worker]):
            steps += a.op is Op.STEP
            if a.op is Op.FORWARD and a.version is not None and not 0 <= a.version <= steps:
                return i
        return None

    def peak_versions(self) -> list[int]:
        """Per worker, the most weight versions it keeps at once (see :meth:`worker_peak_versions`)."""
        return [self.worker_peak_versions(w) for w in range(self.workers)]

    def worker_peak_versions(self, worker: int) -> int:
        """The most weight versions ``worker`` keeps at once (1 means no stashing: a flush schedule).

        A version lives from the step that makes it until it is neither the newest nor used by a
        stashed microbatch or a later forward, the rule the executor frees versions by.
        """
        acts = self.actions[worker]
        uses = self.forward_versions(worker)
        backward = {a.microbatch for a in acts if a.op is Op.BACKWARD}
        need = Counter(uses.values())
        live, newest, peak = {0}, 0, 1
        for a in acts:
            done = a.op is Op.BACKWARD or (a.op is Op.FORWARD and a.microbatch not in backward)
            if done:
                v = uses[a.microbatch]
                need[v] -= 1
                if need[v] == 0 and v != newest:
                    live.discard(v)
            elif a.op is Op.STEP:
                if need[newest] == 0:
                    live.discard(newest)
                newest += 1
                live.add(newest)
            peak = max(peak, len(live))
        return peak

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.stages} stages, {self.microbatches} microbatches"]
        for w, acts in enumerate(self.actions):
            lines.append(f"  worker {w} (stage {self.worker_stage[w]}): " + " ".join(map(str, acts)))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "stages": self.stages,
                "microbatches": self.microbatches,
                "worker_stage": list(self.worker_stage),
                "actions": [[str(a) for a in acts] for acts in self.actions],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        d = json.loads(text)
        return cls(
            d["name"],
            d["stages"],
            d["microbatches"],
            tuple(d["worker_stage"]),
            tuple(tuple(Action.parse(a) for a in acts) for acts in d["actions"]),
        )


def _forward_versions(actions: Sequence[Action]) -> dict[int, int]:
    """Microbatch -> the weight version its forward uses: its own, or the number of steps taken before it."""
    steps, versions = 0, {}
    for a in actions:
        if a.op is Op.STEP:
            steps += 1
        elif a.op is Op.FORWARD:
            versions[a.microbatch] = steps if a.version is None else a.version
    return versions


def _check_sizes(stages: int, microbatches: int, steps: int = 1) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {stages}")
    if microbatches < 1:
        raise ValueError(f"a step needs at least 1 microbatch, got {microbatches}")
    if steps < 1:
        raise ValueError(f"a run needs at least 1 step, got {steps}")


def _layout(stages: int, replicas: Sequence[int] | None, multiple_of: int = 0, what: str = "") -> tuple[int, ...]:
    """Check the replica count of each stage; ``multiple_of`` microbatches must split evenly among them."""
    counts = tuple(replicas) if replicas is not None else (1,) * stages
    if len(counts) != stages or min(counts) < 1:
        raise ValueError(f"replicas must give each of the {stages} stages a count >= 1, got {list(counts)}")
    uneven = [r for r in counts if multiple_of % r]
    if uneven:
        need = math.lcm(*counts)
        raise ValueError(
            f"{multiple_of} {what} cannot be shared round-robin among {uneven[0]} replicas of a stage: "
            f"use a multiple of {need}"
        )
    return counts


def _warmup(replicas: Sequence[int], stage: int) -> int:
    """Forwards a replica of ``stage`` admits before its first backward: the workers from this stage to the
    last, shared among its replicas (PipeDream's NOAM on the input stage; ``stages - stage`` unreplicated)."""
    return -(-sum(replicas[stage:]) // replicas[stage])


def _one_f_one_b(mbs: Sequence[int], warmup: int, step_every: int) -> list[Action]:
    """``warmup`` forwards, then one backward and one forward in turn, then the remaining backwards; an
    optimizer step after every ``step_every`` backwards."""
    order: list[Action] = [Action(Op.FORWARD, k) for k in mbs[:warmup]]
    for i, k in enumerate(mbs):
        order.append(Action(Op.BACKWARD, k))
        if (i + 1) % step_every == 0:
            order.append(Action(Op.STEP))
        if i + warmup < len(mbs):
            order.append(Action(Op.FORWARD, mbs[i + warmup]))
    return order


def _stage_of_workers(replicas: Sequence[int]) -> tuple[int, ...]:
    """Workers are numbered stage by stage: ``(2, 1)`` -> ``(0, 0, 1)``."""
    return tuple(s for s, r in enumerate(replicas) for _ in range(r))


def _with_communication(
    name: str,
    compute: Sequence[Sequence[Action]],
    replicas: Sequence[int],
    route: Callable[[int, int], int] | None = None,
) -> Schedule:
    """Wrap each worker's compute order with the receives it needs and the sends it owes.

    Workers are numbered stage by stage; microbatch ``k`` runs on replica ``k % replicas[s]`` of stage
    ``s`` (unless ``route(stage, k)`` says otherwise), so its backward returns to the replicas that ran
    its forward. A forward on a stage after the
    first receives its input from the previous stage; one before the last sends its output on; backwards
    do the same for gradients in the other direction. Receives sit right before their use, so the
    executor blocks only on data it needs next; sends are asynchronous.
    """
    first_worker = [sum(replicas[:s]) for s in range(len(replicas))]
    worker_stage = _stage_of_workers(replicas)
    last = len(replicas) - 1

    def round_robin(stage: int, k: int) -> int:
        return first_worker[stage] + k % replicas[stage]

    worker = route or round_robin

    programs = []
    for w, order in enumerate(compute):
        s = worker_stage[w]
        prog: list[Action] = []
        for a in order:
            k = a.microbatch
            if a.op is Op.FORWARD:
                if s > 0:
                    prog.append(Action(Op.RECV_ACTIVATION, k, worker(s - 1, k)))
                prog.append(a)
                if s < last:
                    prog.append(Action(Op.SEND_ACTIVATION, k, worker(s + 1, k)))
            elif a.op is Op.BACKWARD:
                if s < last:
                    prog.append(Action(Op.RECV_GRAD, k, worker(s + 1, k)))
                prog.append(a)
                if s > 0:
                    prog.append(Action(Op.SEND_GRAD, k, worker(s - 1, k)))
            else:
                prog.append(a)
        programs.append(tuple(prog))
    total = sum(a.op is Op.FORWARD for w, acts in enumerate(compute) if worker_stage[w] == 0 for a in acts)
    return Schedule(name, len(replicas), total, worker_stage, tuple(programs))


def _replica_microbatches(replicas: Sequence[int], first: int, count: int) -> list[list[int]]:
    """Microbatches ``first .. first + count - 1`` of each worker, routed round-robin within each stage."""
    return [[k for k in range(first, first + count) if k % r == j] for r in replicas for j in range(r)]


def gpipe(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """GPipe: per step, every worker runs all its forwards, then all its backwards, then one optimizer step.

    Peak stashed activations per worker: its share of ``microbatches``.
    """
    _check_sizes(stages, microbatches, steps)
    reps = _layout(stages, replicas, microbatches, "microbatches per step")
    compute: list[list[Action]] = [[] for _ in range(sum(reps))]
    for t in range(steps):
        for w, mbs in enumerate(_replica_microbatches(reps, t * microbatches, microbatches)):
            compute[w] += [*(Action(Op.FORWARD, k) for k in mbs), *(Action(Op.BACKWARD, k) for k in mbs)]
            compute[w].append(Action(Op.STEP))
    return _with_communication("gpipe", compute, reps)


def flush(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream-Flush (synchronous 1F1B): per step, warm-up forwards, one-forward-one-backward, cool-down,
    optimizer step.

    An unreplicated stage ``s`` runs ``stages - s`` forwards before its first backward, so it holds at most
    that many stashed activations (GPipe holds ``microbatches``); the step time is the same.
    """
    _check_sizes(stages, microbatches, steps)
    reps = _layout(stages, replicas, microbatches, "microbatches per step")
    stage_of = _stage_of_workers(reps)
    compute: list[list[Action]] = [[] for _ in range(sum(reps))]
    for t in range(steps):
        for w, mbs in enumerate(_replica_microbatches(reps, t * microbatches, microbatches)):
            compute[w] += _one_f_one_b(mbs, _warmup(reps, stage_of[w]), len(mbs))
    return _with_communication("flush", compute, reps)


def pipedream(
    stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None, vertical_sync: bool = False
) -> Schedule:
    """PipeDream: asynchronous 1F1B with weight stashing, one fill and one drain for the whole run.

    Every microbatch is a minibatch of its own: each stage updates its weights after every backward
    (replicas of a stage after each round of one backward each, averaging their gradients). A replica of
    the input stage admits NOAM = ceil(workers / input replicas) minibatches before its first backward.
    Each forward uses the newest weights, each backward the version of its forward, so on an
    unreplicated stage ``s`` the update making ``W(t+1)`` uses the gradient at ``W(t - (stages-1-s))``.

    With ``vertical_sync`` a minibatch uses, on every stage, the version that was newest on the input
    stage when it entered (on a stage with ``r`` replicas against ``r0`` on the input stage, the newest
    whose minibatches the input stage's version had all seen: ``floor(version * r0 / r)``).
    """
    _check_sizes(stages, microbatches, steps)
    total = microbatches * steps
    reps = _layout(stages, replicas, total, "minibatches in the run")
    stage_of = _stage_of_workers(reps)
    per_worker = _replica_microbatches(reps, 0, total)
    compute = [_one_f_one_b(mbs, _warmup(reps, stage_of[w]), 1) for w, mbs in enumerate(per_worker)]
    if vertical_sync:
        entered = {k: v for w in range(reps[0]) for k, v in _forward_versions(compute[w]).items()}
        compute = [
            _pinned(order, lambda k, s=stage_of[w]: entered[k] * reps[0] // reps[s]) for w, order in enumerate(compute)
        ]
    return _with_communication("pipedream-vs" if vertical_sync else "pipedream", compute, reps)


def twobw(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream-2BW: asynchronous 1F1B with two weight versions, one fill and one drain for the run.

    Gradients accumulate over the ``microbatches`` of each step; every microbatch of step ``t`` uses
    version ``W(t-1)`` on every stage, so ``W(t+1) = W(t) - lr * grad f(W(t-1))`` and each stage keeps
    two versions (the newest and the one in use).

    Raises:
        ValueError: too few microbatches per step for two versions to suffice.
    """
    _check_sizes(stages, microbatches, steps)
    reps = _layout(stages, replicas, microbatches, "microbatches per step")
    schedule = _twobw(microbatches, steps, reps)
    if not _two_versions_suffice(schedule):
        need = twobw_min_microbatches(reps, microbatches + 1)
        raise ValueError(
            f"PipeDream-2BW with {microbatches} microbatches per step on replicas {list(reps)} would need more "
            f"than two weight versions: use at least {need} microbatches per step"
        )
    return schedule


def _twobw(microbatches: int, steps: int, replicas: Sequence[int]) -> Schedule:
    stage_of = _stage_of_workers(replicas)
    compute = []
    for w, mbs in enumerate(_replica_microbatches(replicas, 0, microbatches * steps)):
        order = _one_f_one_b(mbs, _warmup(replicas, stage_of[w]), microbatches // replicas[stage_of[w]])
        compute.append(_pinned(order, lambda k: max(k // microbatches - 1, 0)))
    return _with_communication("2bw", compute, replicas)


def _pinned(order: Sequence[Action], version_of: Callable[[int], int]) -> list[Action]:
    """``order`` with each forward's weight version set to ``version_of(microbatch)``."""
    return [Action(a.op, a.microbatch, a.peer, version_of(a.microbatch)) if a.op is Op.FORWARD else a for a in order]


def twobw_min_microbatches(replicas: Sequence[int], at_least: int = 1) -> int:
    """The fewest microbatches per step, from ``at_least`` on, with which PipeDream-2BW on ``replicas`` needs
    only two weight versions (a multiple of every replica count)."""
    step = math.lcm(*replicas)
    m = -(-at_least // step) * step
    while not _two_versions_suffice(_twobw(m, 3, replicas)):
        m += step
    return m


def _two_versions_suffice(schedule: Schedule) -> bool:
    """Every forward's version exists when it runs, and no worker keeps more than two."""
    workers = range(schedule.workers)
    return all(schedule.unmade_version(w) is None for w in workers) and max(schedule.peak_versions()) <= 2


def forward_only(stages: int, microbatches: int, replicas: Sequence[int] | None = None) -> Schedule:
    """Evaluation: forwards only, no backward, no stash, no step; only the first replica of each stage works,
    so the whole output arrives on one worker."""
    _check_sizes(stages, microbatches)
    reps = _layout(stages, replicas)
    stage_of = _stage_of_workers(reps)
    firsts = [stage_of.index(s) for s in range(stages)]
    compute = [
        [Action(Op.FORWARD, k) for k in range(microbatches)] if w in firsts else [] for w in range(len(stage_of))
    ]
    return _with_communication("forward", compute, reps, route=lambda stage, k: firsts[stage])


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "flush": flush,
    "pipedream": pipedream,
    "pipedream-vs": partial(pipedream, vertical_sync=True),
    "2bw": twobw,
}
ASYNCHRONOUS = frozenset({"pipedream", "pipedream-vs", "2bw"})


def make_schedule(
    name: str, stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None
) -> Schedule:
    """Build the training schedule called ``name`` (one of :data:`SCHEDULES`) for ``steps`` steps of
    ``microbatches`` microbatches, with ``replicas[s]`` data-parallel workers on stage ``s``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name](stages, microbatches, steps, replicas)
