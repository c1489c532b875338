"""Discrete-event simulation of a schedule's action lists: run time and peak stash, before running it.

Each worker runs its actions in order. A forward or backward takes its stage's time, a send is
asynchronous (it costs the sender nothing), a receive waits for the message, and messages between two
workers are delivered in the order they were sent, as the executor's point-to-point channels deliver
them. Each stage boundary is one link, as in the planner's cost model: it carries one message at a time,
activations and gradients alike, each taking ``transfer`` seconds. A ``REDUCE`` waits for every replica
of its stage to reach it (their all-reduce) and then takes the stage's reduce time; a ``STEP`` takes the
optimizer step's time.

Example:
    >>> from conveyor.schedule import flush
    >>> simulate(flush(stages=4, microbatches=8), forward_s=1.0, backward_s=2.0).step_s
    33.0
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.schedule._actions import Action, Op
from conveyor.schedule._grid import action_grid
from conveyor.schedule._schedule import Schedule

__all__ = ["DeadlockError", "ScheduleError", "SimResult", "simulate"]


class ScheduleError(ValueError):
    """An action list that cannot run as written (a receive with no matching send, wrong order, ...)."""


class DeadlockError(ScheduleError):
    """Every unfinished worker waits on a message or on replicas that never come."""


@dataclass
class SimResult:
    """What a simulated run of one schedule predicts.

    Attributes:
        step_s: time from the first action to the last worker's last action.
        finish_s: per worker, when its last action ends.
        busy_s: per worker, the time spent in forwards, backwards, reduces and optimizer steps.
        peak_stashed: per worker, the most microbatches whose forward ran and whose backward is pending.
        timeline: ``(worker, action, start, end)`` for every compute action, in execution order.
    """

    step_s: float
    finish_s: list[float]
    busy_s: list[float]
    peak_stashed: list[int]
    timeline: list[tuple[int, Action, float, float]] = field(repr=False)

    def efficiency(self) -> float:
        """Mean fraction of the run that workers spend computing (1.0 means no bubble)."""
        return sum(self.busy_s) / (len(self.busy_s) * self.step_s) if self.step_s > 0 else 1.0


def _per_item(value: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{what} needs {n} values (or one number for all), got {len(values)}")
    return values


class _Run:
    """The simulation's state: every worker's clock, position, stash and messages in flight."""

    def __init__(self, schedule: Schedule, costs: dict[Op, list[float]], hop: list[float], step_s: float) -> None:
        n = schedule.workers
        self.schedule, self.costs, self.hop, self.step_s = schedule, costs, hop, step_s
        self.stage = schedule.worker_stage
        self.replicas = schedule.replicas
        self.pending_backward = [{a.microbatch for a in acts if a.op is Op.BACKWARD} for acts in schedule.actions]
        self.clock, self.busy, self.pc, self.peak = [0.0] * n, [0.0] * n, [0] * n, [0] * n
        self.stashed: list[set[int | None]] = [set() for _ in range(n)]
        self.channels: dict[tuple[int, int, bool], deque[tuple[int | None, float]]] = {}
        self.link_free = [0.0] * len(hop)  # when each boundary's link finishes its last message
        self.timeline: list[tuple[int, Action, float, float]] = []
        self.reduces_done = [0] * n
        self.at_reduce: dict[tuple[int, int], dict[int, float]] = {}  # (stage, reduce index) -> worker -> arrival

    def step(self, w: int) -> bool:
        """Run worker ``w``'s next action if it can; False if it waits on a message or its replicas."""
        a = self.schedule.actions[w][self.pc[w]]
        if a.op.is_recv:
            q = self.channels.get((a.to, w, a.op is Op.RECV_GRAD))
            if not q:
                return False
            mb, arrival = q.popleft()
            if mb != a.microbatch:
                raise ScheduleError(
                    f"worker {w} expects microbatch {a.microbatch} from worker {a.peer} ({a}) but the next message "
                    f"on that channel is microbatch {mb}: reorder the receives to match the sends\n"
                    + action_grid(self.schedule, {w: self.pc[w]})
                )
            self.clock[w] = max(self.clock[w], arrival)
        elif a.op.is_send:
            boundary = min(self.stage[w], self.stage[a.to])
            self.link_free[boundary] = max(self.link_free[boundary], self.clock[w]) + self.hop[boundary]
            channel = self.channels.setdefault((w, a.to, a.op is Op.SEND_GRAD), deque())
            channel.append((a.microbatch, self.link_free[boundary]))
        else:
            if a.op is Op.REDUCE_GRAD and not self._all_replicas_arrived(w):
                return False
            duration = self.step_s if a.op is Op.STEP else self.costs[a.op][self.stage[w]]
            self.timeline.append((w, a, self.clock[w], self.clock[w] + duration))
            self.clock[w] += duration
            self.busy[w] += duration
            if a.op is Op.FORWARD and a.microbatch in self.pending_backward[w]:
                self.stashed[w].add(a.microbatch)
                self.peak[w] = max(self.peak[w], len(self.stashed[w]))
            elif a.op is Op.BACKWARD:
                self.stashed[w].discard(a.microbatch)
        self.pc[w] += 1
        return True

    def _all_replicas_arrived(self, w: int) -> bool:
        """An all-reduce: record ``w``'s arrival; once every replica is there, all start at the latest arrival."""
        stage = self.stage[w]
        arrived = self.at_reduce.setdefault((stage, self.reduces_done[w]), {})
        arrived.setdefault(w, self.clock[w])
        if len(arrived) < self.replicas[stage]:
            return False
        self.clock[w] = max(arrived.values())
        self.reduces_done[w] += 1
        return True


def simulate(
    schedule: Schedule,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    transfer_s: float | Sequence[float] = 0.0,
    step_s: float = 0.0,
    reduce_s: float | Sequence[float] = 0.0,
) -> SimResult:
    """Run ``schedule`` on a model of time and return its predicted timing and memory.

    Args:
        schedule: the action lists to run.
        forward_s: forward time of one microbatch, per stage (or one number for every stage).
        backward_s: backward time of one microbatch, per stage (or one number).
        transfer_s: time for a message to cross the boundary after stage ``s``, per boundary
            (``stages - 1`` values, or one number); activations and gradients take the same time.
        step_s: time of one optimizer step.
        reduce_s: time of one ``REDUCE`` once every replica has arrived (the all-reduce), per stage (or one number).

    Raises:
        DeadlockError: the workers wait on each other forever.
        ScheduleError: a receive gets a different microbatch than it expects, or a message is left unread.
    """
    n = schedule.stages
    costs = {
        Op.FORWARD: _per_item(forward_s, n, "forward_s"),
        Op.BACKWARD: _per_item(backward_s, n, "backward_s"),
        Op.REDUCE_GRAD: _per_item(reduce_s, n, "reduce_s"),
    }
    run = _Run(schedule, costs, _per_item(transfer_s, max(n - 1, 0), "transfer_s"), step_s)
    # Workers advance in time order (the earliest clock first), so a shared link serves messages in the
    # order they are sent; a worker that waits leaves the queue until a message or its replicas wake it.
    ready = [(0.0, w) for w in range(schedule.workers) if schedule.actions[w]]
    waiting: set[int] = set()
    same_stage = [[v for v in range(schedule.workers) if run.stage[v] == k] for k in range(n)]
    while ready:
        _, w = heapq.heappop(ready)
        a = schedule.actions[w][run.pc[w]]
        if not run.step(w):
            waiting.add(w)
            continue
        woken = [a.peer] if a.op.is_send else same_stage[run.stage[w]] if a.op is Op.REDUCE_GRAD else []
        for v in woken:
            if v in waiting:
                waiting.discard(v)
                heapq.heappush(ready, (run.clock[w], v))
        if run.pc[w] < len(schedule.actions[w]):
            heapq.heappush(ready, (run.clock[w], w))
    if waiting:
        stuck = "; ".join(f"worker {w} at {schedule.actions[w][run.pc[w]]}" for w in sorted(waiting))
        raise DeadlockError(
            f"deadlock: {stuck} wait for messages or replicas' reduces that never come\n"
            + action_grid(schedule, {w: run.pc[w] for w in waiting})
        )
    unread = [(k, len(q)) for k, q in run.channels.items() if q]
    if unread:
        (src, dst, grad), count = unread[0]
        kind = "gradient" if grad else "activation"
        raise ScheduleError(f"{count} {kind} message(s) from worker {src} to {dst} are sent but never received")
    return SimResult(max(run.clock, default=0.0), run.clock, run.busy, run.peak, run.timeline)
