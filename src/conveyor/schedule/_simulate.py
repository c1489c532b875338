"""Discrete-event simulation of a schedule's action lists: step time and peak stash, before running it.

Each worker runs its actions in order. A forward or backward takes its stage's time, a send is
asynchronous (it costs the sender nothing), a receive waits for the message, and messages between two
workers are delivered in the order they were sent, as the executor's point-to-point channels deliver
them. Each stage boundary is one link, as in the planner's cost model: it carries one message at a time,
activations and gradients alike, each taking ``transfer`` seconds.

Example:
    >>> from conveyor.schedule._schedule import flush
    >>> simulate(flush(stages=4, microbatches=8), forward_s=1.0, backward_s=2.0).step_s
    33.0
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.schedule._schedule import Action, Op, Schedule

__all__ = ["DeadlockError", "ScheduleError", "SimResult", "simulate"]


class ScheduleError(ValueError):
    """An action list that cannot run as written (a receive with no matching send, wrong order, ...)."""


class DeadlockError(ScheduleError):
    """Every unfinished worker waits on a message that is never sent."""


@dataclass
class SimResult:
    """What a simulated run of one schedule predicts.

    Attributes:
        step_s: time from the first action to the last worker's last action.
        finish_s: per worker, when its last action ends.
        busy_s: per worker, the time spent in forwards, backwards and optimizer steps.
        peak_stashed: per worker, the most microbatches whose forward ran and whose backward is pending.
        timeline: ``(worker, action, start, end)`` for every compute action, in execution order.
    """

    step_s: float
    finish_s: list[float]
    busy_s: list[float]
    peak_stashed: list[int]
    timeline: list[tuple[int, Action, float, float]] = field(repr=False)

    def efficiency(self) -> float:
        """Mean fraction of the step that workers spend computing (1.0 means no bubble)."""
        return sum(self.busy_s) / (len(self.busy_s) * self.step_s) if self.step_s > 0 else 1.0


def _per_item(value: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{what} needs {n} values (or one number for all), got {len(values)}")
    return values


def simulate(
    schedule: Schedule,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    transfer_s: float | Sequence[float] = 0.0,
    step_s: float = 0.0,
) -> SimResult:
    """Run ``schedule`` on a model of time and return its predicted timing and memory.

    Args:
        schedule: the action lists to run.
        forward_s: forward time of one microbatch, per stage (or one number for every stage).
        backward_s: backward time of one microbatch, per stage (or one number).
        transfer_s: time for a message to cross the boundary after stage ``s``, per boundary
            (``stages - 1`` values, or one number); activations and gradients take the same time.
        step_s: time of one optimizer step.

    Raises:
        DeadlockError: the workers wait on each other forever.
        ScheduleError: a receive gets a different microbatch than it expects, or a message is left unread.
    """
    n = schedule.stages
    fwd, bwd = _per_item(forward_s, n, "forward_s"), _per_item(backward_s, n, "backward_s")
    hop = _per_item(transfer_s, max(n - 1, 0), "transfer_s")
    stage = schedule.worker_stage
    pending_backward = [{a.microbatch for a in acts if a.op is Op.BACKWARD} for acts in schedule.actions]
    clock = [0.0] * schedule.workers
    busy = [0.0] * schedule.workers
    pc = [0] * schedule.workers
    stashed: list[set[int | None]] = [set() for _ in range(schedule.workers)]
    peak = [0] * schedule.workers
    channels: dict[tuple[int, int, bool], deque[tuple[int | None, float]]] = {}
    link_free = [0.0] * len(hop)  # when each boundary's link finishes its last message
    timeline: list[tuple[int, Action, float, float]] = []
    replicas = schedule.replicas
    steps_done = [0] * schedule.workers
    at_step: dict[tuple[int, int], dict[int, float]] = {}  # (stage, step index) -> worker -> arrival

    def run_one(w: int) -> bool:
        """Run worker ``w``'s next action if it can; False if it waits on a message."""
        a = schedule.actions[w][pc[w]]
        if a.op.is_recv:
            q = channels.get((a.peer, w, a.op is Op.RECV_GRAD))
            if not q:
                return False
            mb, arrival = q.popleft()
            if mb != a.microbatch:
                raise ScheduleError(
                    f"worker {w} expects microbatch {a.microbatch} from worker {a.peer} ({a}) but the "
                    f"next message on that channel is microbatch {mb}: reorder the receives to match the sends"
                )
            clock[w] = max(clock[w], arrival)
        elif a.op.is_send:
            boundary = min(stage[w], stage[a.peer])
            link_free[boundary] = max(link_free[boundary], clock[w]) + hop[boundary]
            channels.setdefault((w, a.peer, a.op is Op.SEND_GRAD), deque()).append((a.microbatch, link_free[boundary]))
        else:
            if a.op is Op.STEP and replicas[stage[w]] > 1:
                # An all-reduce: every replica must arrive before any of them goes on.
                arrived = at_step.setdefault((stage[w], steps_done[w]), {})
                arrived.setdefault(w, clock[w])
                if len(arrived) < replicas[stage[w]]:
                    return False
                clock[w] = max(arrived.values())
            steps_done[w] += a.op is Op.STEP
            cost = {Op.FORWARD: fwd, Op.BACKWARD: bwd}.get(a.op)
            duration = step_s if cost is None else cost[stage[w]]
            timeline.append((w, a, clock[w], clock[w] + duration))
            clock[w] += duration
            busy[w] += duration
            if a.op is Op.FORWARD and a.microbatch in pending_backward[w]:
                stashed[w].add(a.microbatch)
                peak[w] = max(peak[w], len(stashed[w]))
            elif a.op is Op.BACKWARD:
                stashed[w].discard(a.microbatch)
        pc[w] += 1
        return True

    # Workers advance in time order (the earliest clock first), so a shared link serves messages in the
    # order they are sent; a worker that waits leaves the queue until a message or its replicas wake it.
    ready = [(0.0, w) for w in range(schedule.workers) if schedule.actions[w]]
    waiting: set[int] = set()
    same_stage = [[v for v in range(schedule.workers) if stage[v] == k] for k in range(n)]
    while ready:
        _, w = heapq.heappop(ready)
        a = schedule.actions[w][pc[w]]
        if not run_one(w):
            waiting.add(w)
            continue
        woken = [a.peer] if a.op.is_send else same_stage[stage[w]] if a.op is Op.STEP else []
        for v in woken:
            if v in waiting:
                waiting.discard(v)
                heapq.heappush(ready, (clock[w], v))
        if pc[w] < len(schedule.actions[w]):
            heapq.heappush(ready, (clock[w], w))
    if waiting:
        stuck = [f"worker {w} at {schedule.actions[w][pc[w]]} (action {pc[w]})" for w in sorted(waiting)]
        raise DeadlockError("deadlock: " + "; ".join(stuck) + " wait for messages or replicas' steps that never come")
    unread = [(k, len(q)) for k, q in channels.items() if q]
    if unread:
        (src, dst, grad), count = unread[0]
        kind = "gradient" if grad else "activation"
        raise ScheduleError(f"{count} {kind} message(s) from worker {src} to {dst} are sent but never received")
    return SimResult(max(clock, default=0.0), clock, busy, peak, timeline)
