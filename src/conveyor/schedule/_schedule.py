"""Pipeline schedules as data: one ordered list of actions per worker.

A schedule says, for every worker, what to do and in which order: run the forward or backward of a
microbatch, send or receive an activation or a gradient, reduce the gradients of an update, step the
optimizer. The same lists feed the validator (:func:`~conveyor.schedule.validate`), the simulator
(:func:`~conveyor.schedule.simulate`) and the executor (which runs the same generator as it goes, see
:mod:`conveyor.schedule._generate`), so what is checked and predicted is exactly what runs.

Example:
    >>> print(flush(stages=2, microbatches=2))
    flush: 2 stages, 2 microbatches
      worker 0 (stage 0): F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 RECV_B1<1 B1 REDUCE STEP
      worker 1 (stage 1): RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 REDUCE STEP
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import InputError
from conveyor.schedule._actions import Action, Op
from conveyor.schedule._generate import Batches, with_communication, worker_actions
from conveyor.schedule._kinds import KINDS, Kind, kind
from conveyor.schedule._layout import check_replicas, worker_stages

__all__ = [
    "SCHEDULES",
    "Schedule",
    "flush",
    "forward_only",
    "gpipe",
    "make_schedule",
    "pipedream",
    "twobw",
    "twobw_min_microbatches",
]

SCHEDULES = tuple(sorted(KINDS))


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for a run (or one evaluation pass).

    Attributes:
        name: the schedule (``"gpipe"``, ``"flush"``, ..., or ``"forward"`` for evaluation).
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

    @property
    def kind(self) -> Kind | None:
        """The schedule's record (``None`` for an evaluation pass)."""
        return KINDS.get(self.name)

    def forward_versions(self, worker: int) -> dict[int, int]:
        """The weight version each of ``worker``'s forwards uses (a ``None`` version resolved to the newest)."""
        steps, versions = 0, {}
        for a in self.actions[worker]:
            if a.op is Op.STEP:
                steps += 1
            elif a.op is Op.FORWARD:
                versions[a.mb] = steps if a.version is None else a.version
        return versions

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
                v = uses[a.mb]
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


def make_schedule(
    name: str, stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None
) -> Schedule:
    """The training schedule called ``name`` (one of :data:`SCHEDULES`) for a run of ``steps`` batches of
    ``microbatches`` microbatches, with ``replicas[s]`` data-parallel workers on stage ``s`` (any counts:
    microbatch ``k`` runs on replica ``k % replicas[s]``).

    Raises:
        ValueError: an unknown name, a size below 1, or a layout without one count >= 1 per stage; for 2BW,
            too few microbatches per batch for two weight versions to suffice.
    """
    record = kind(name)
    _check_sizes(stages, microbatches, steps)
    reps = check_replicas(stages, replicas)
    schedule = _materialize(record, microbatches, steps, reps)
    if record.weights == "previous" and not _two_versions_suffice(schedule):
        need = twobw_min_microbatches(reps, microbatches + 1)
        raise InputError(
            f"PipeDream-2BW with {microbatches} microbatches per step on replicas {list(reps)} would need more "
            f"than two weight versions: use at least {need} microbatches per step"
        )
    return schedule


def _materialize(record: Kind, microbatches: int, steps: int, replicas: Sequence[int]) -> Schedule:
    run = Batches(steps)
    actions = tuple(tuple(worker_actions(record, w, replicas, microbatches, run)) for w in range(sum(replicas)))
    return Schedule(record.name, len(replicas), microbatches * steps, worker_stages(replicas), actions)


def _check_sizes(stages: int, microbatches: int, steps: int = 1) -> None:
    if stages < 1:
        raise InputError(f"a pipeline needs at least 1 stage, got {stages}")
    if microbatches < 1:
        raise InputError(f"a step needs at least 1 microbatch, got {microbatches}")
    if steps < 1:
        raise InputError(f"a run needs at least 1 step, got {steps}")


def gpipe(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """GPipe: per batch, every worker runs all its forwards, then all its backwards, then reduces and steps.

    Peak stashed activations per worker: its share of ``microbatches``.
    """
    return make_schedule("gpipe", stages, microbatches, steps, replicas)


def flush(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream-Flush (synchronous 1F1B): per batch, warm-up forwards, one-forward-one-backward, cool-down,
    reduce, step.

    An unreplicated stage ``s`` runs ``stages - s`` forwards before its first backward, so it holds at most
    that many stashed activations (GPipe holds ``microbatches``); the step time is the same.
    """
    return make_schedule("flush", stages, microbatches, steps, replicas)


def pipedream(
    stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None, vertical_sync: bool = False
) -> Schedule:
    """PipeDream: asynchronous 1F1B with weight stashing, one fill and one drain for the whole run.

    Every microbatch is a minibatch of its own: each stage updates its weights after every round of one
    backward per replica (its gradients averaged over the round). A replica of the input stage admits
    NOAM = ceil(workers / input replicas) minibatches before its first backward. Each forward uses the newest
    weights, each backward the version of its forward, so on an unreplicated stage ``s`` the update making
    ``W(t+1)`` uses the gradient at ``W(t - (stages-1-s))``.

    With ``vertical_sync`` a minibatch uses, on every stage, the version that was newest on the input
    stage when it entered (see :meth:`~conveyor.schedule.Kind.version`).
    """
    return make_schedule("pipedream-vs" if vertical_sync else "pipedream", stages, microbatches, steps, replicas)


def twobw(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None) -> Schedule:
    """PipeDream-2BW: asynchronous 1F1B with two weight versions, one fill and one drain for the run.

    Gradients accumulate over the ``microbatches`` of each batch; every microbatch of batch ``t`` uses
    version ``W(t-1)`` on every stage, so ``W(t+1) = W(t) - lr * grad f(W(t-1))`` and each stage keeps
    two versions (the newest and the one in use).

    Raises:
        ValueError: too few microbatches per step for two versions to suffice.
    """
    return make_schedule("2bw", stages, microbatches, steps, replicas)


def twobw_min_microbatches(replicas: Sequence[int], at_least: int = 1) -> int:
    """The fewest microbatches per step, from ``at_least`` on, with which PipeDream-2BW on ``replicas`` needs
    only two weight versions."""
    m = max(at_least, 1)
    while not _two_versions_suffice(_materialize(KINDS["2bw"], m, 2 + math.lcm(*replicas), replicas)):
        m += 1
    return m


def _two_versions_suffice(schedule: Schedule) -> bool:
    """Every forward's version exists when it runs, and no worker keeps more than two."""
    workers = range(schedule.workers)
    return all(schedule.unmade_version(w) is None for w in workers) and max(schedule.peak_versions()) <= 2


def forward_only(stages: int, microbatches: int, replicas: Sequence[int] | None = None) -> Schedule:
    """Evaluation: forwards only, no backward, no stash, no step; only the first replica of each stage works,
    so the whole output arrives on one worker."""
    _check_sizes(stages, microbatches)
    reps = check_replicas(stages, replicas)
    stage_of = worker_stages(reps)
    firsts = [stage_of.index(s) for s in range(stages)]
    actions = tuple(
        tuple(
            with_communication(
                [Action(Op.FORWARD, k) for k in range(microbatches)] if w in firsts else [],
                w,
                reps,
                route=lambda stage, k: firsts[stage],
            )
        )
        for w in range(len(stage_of))
    )
    return Schedule("forward", stages, microbatches, stage_of, actions)
