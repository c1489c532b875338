"""Pipeline schedules as data: one ordered list of actions per worker.

A schedule says, for every worker, what to do and in which order: run the forward or backward of a
microbatch, send or receive an activation or a gradient, step the optimizer. The same lists feed the
validator (:mod:`conveyor.validate`), the simulator (:mod:`conveyor.simulate`) and the executor
(:mod:`conveyor.executor`), so what is checked and predicted is exactly what runs.

Example:
    >>> print(flush(stages=2, microbatches=2))
    flush: 2 stages, 2 microbatches
      worker 0 (stage 0): F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 RECV_B1<1 B1 STEP
      worker 1 (stage 1): RECV_F0<0 F0 B0 SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 STEP
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "SCHEDULES",
    "Action",
    "Op",
    "Schedule",
    "flush",
    "forward_only",
    "gpipe",
    "make_schedule",
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
    """

    op: Op
    microbatch: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        if self.peer is None:
            return f"{self.op.value}{mb}"
        return f"{self.op.value}{mb}{'>' if self.op.is_send else '<'}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"SEND_F3>1"`` -> ``Action(Op.SEND_ACTIVATION, 3, 1)``."""
        for op in sorted(Op, key=lambda o: -len(o.value)):
            if text.startswith(op.value):
                rest = text[len(op.value) :]
                mb, _, peer = rest.replace("<", ">").partition(">")
                return cls(op, int(mb) if mb else None, int(peer) if peer else None)
        raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F0', 'RECV_B2<1', 'STEP'")


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists for one optimizer step (or one evaluation pass).

    Attributes:
        name: the generator that made it (``"gpipe"``, ``"flush"``, ...).
        stages: number of pipeline stages.
        microbatches: microbatches per step.
        worker_stage: the stage each worker runs (one worker per stage: ``(0, 1, ..., stages-1)``).
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


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {stages}")
    if microbatches < 1:
        raise ValueError(f"a step needs at least 1 microbatch, got {microbatches}")


def _with_communication(name: str, compute: Sequence[Sequence[Action]], microbatches: int) -> Schedule:
    """Wrap each stage's compute order with the receives it needs and the sends it owes.

    A forward on stage s > 0 first receives its input from s - 1; a forward on a stage before the last
    sends its output on. A backward on a stage before the last first receives the output's gradient; a
    backward on s > 0 sends the input's gradient back. Receives sit right before their use, so the
    executor blocks only on data it needs next; sends are asynchronous.
    """
    last = len(compute) - 1
    programs = []
    for s, order in enumerate(compute):
        prog: list[Action] = []
        for a in order:
            if a.op is Op.FORWARD:
                if s > 0:
                    prog.append(Action(Op.RECV_ACTIVATION, a.microbatch, s - 1))
                prog.append(a)
                if s < last:
                    prog.append(Action(Op.SEND_ACTIVATION, a.microbatch, s + 1))
            elif a.op is Op.BACKWARD:
                if s < last:
                    prog.append(Action(Op.RECV_GRAD, a.microbatch, s + 1))
                prog.append(a)
                if s > 0:
                    prog.append(Action(Op.SEND_GRAD, a.microbatch, s - 1))
            else:
                prog.append(a)
        programs.append(tuple(prog))
    return Schedule(name, len(compute), microbatches, tuple(range(len(compute))), tuple(programs))


def _f(i: int) -> Action:
    return Action(Op.FORWARD, i)


def _b(i: int) -> Action:
    return Action(Op.BACKWARD, i)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, then one optimizer step.

    Peak stashed activations per stage: ``microbatches``.
    """
    _check_sizes(stages, microbatches)
    m = range(microbatches)
    order = [*map(_f, m), *map(_b, m), Action(Op.STEP)]
    return _with_communication("gpipe", [order] * stages, microbatches)


def flush(stages: int, microbatches: int) -> Schedule:
    """PipeDream-Flush (synchronous 1F1B): warm-up forwards, one-forward-one-backward, cool-down, step.

    Stage ``s`` runs ``min(stages - 1 - s, microbatches)`` warm-up forwards, so it holds at most
    ``stages - s`` stashed activations (GPipe holds ``microbatches``); the step time is the same.
    """
    _check_sizes(stages, microbatches)
    compute = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [_f(i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            order += [_f(warmup + i), _b(i)]
        order += [_b(i) for i in range(microbatches - warmup, microbatches)]
        compute.append([*order, Action(Op.STEP)])
    return _with_communication("flush", compute, microbatches)


def forward_only(stages: int, microbatches: int) -> Schedule:
    """Evaluation: forwards only, no backward, no stash, no step."""
    _check_sizes(stages, microbatches)
    return _with_communication("forward", [list(map(_f, range(microbatches)))] * stages, microbatches)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "flush": flush}


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """Build the training schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name](stages, microbatches)
