"""Discrete-event simulation of a schedule's action lists: run time and peak stash, before running it.

Each worker runs its actions in order. A forward or backward takes its stage's time; a send costs its
sender ``send_s`` (packing the message, handing it to the transport) and does not wait for delivery; a
receive waits for the message and then costs ``recv_s``; messages between two workers are delivered in
the order they were sent, as the executor's point-to-point channels deliver them. Each worker has one
full-duplex link, as in the planner's cost model: a message keeps its sender's link busy outwards and its
receiver's inwards for the boundary's ``transfer`` seconds (each carries one message at a time each way,
activations and gradients alike), then spends ``latency`` more in flight. Workers may sit in groups (a server's,
a rack's) whose link to the level above they share: a message between two groups keeps the sender's group's link
busy outwards and the receiver's inwards too, at every level where their groups differ. A ``REDUCE`` waits for every
replica of its stage to reach it (their all-reduce) and then takes the stage's reduce time; a ``STEP``
takes the optimizer step's time. With ``cores``, the workers that want a core at the same moment share
them equally.

Example:
    >>> from conveyor.schedule import flush
    >>> simulate(flush(stages=4, microbatches=8), forward_s=1.0, backward_s=2.0).step_s
    33.0
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.errors import InputError
from conveyor.schedule._actions import Action, Op
from conveyor.schedule._grid import action_grid
from conveyor.schedule._schedule import Schedule

__all__ = ["DeadlockError", "ScheduleError", "SimResult", "simulate"]


class ScheduleError(InputError):
    """An action list that cannot run as written (a receive with no matching send, wrong order, ...)."""


class DeadlockError(ScheduleError):
    """Every unfinished worker waits on a message or on replicas that never come."""


@dataclass
class SimResult:
    """What a simulated run of one schedule predicts.

    Attributes:
        step_s: the run's time, from the first action to the last worker's last action.
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
        raise InputError(f"{what} needs {n} values (or one number for all), got {len(values)}")
    return values


class _Worker:
    """One worker in the simulation: where it is in its actions and what it is doing now."""

    def __init__(self) -> None:
        self.pc = 0
        self.state = "ready"  # ready | cpu (using a core) | delay (waiting for a time) | wait (for a peer)
        self.work = 0.0  # core-seconds left of the running action
        self.until = 0.0  # end of a delay
        self.started = 0.0
        self.finished = 0.0
        self.busy = 0.0
        self.stashed: set[int | None] = set()
        self.peak = 0
        self.reduces = 0


class _Run:
    """The simulation: a global clock, every worker's state, the messages in flight and the shared cores."""

    def __init__(
        self,
        schedule: Schedule,
        costs: dict[Op, list[float]],
        *,
        hop: list[float],
        delay: list[float],
        send_s: float,
        recv_s: float,
        cores: int | None,
        groups: Sequence[Sequence[int]],
    ) -> None:
        self.schedule, self.costs, self.hop, self.delay = schedule, costs, hop, delay
        self.groups = groups
        self.send_s, self.recv_s = send_s, recv_s
        self.cores = cores
        self.stage, self.replicas = schedule.worker_stage, schedule.replicas
        self.workers = [_Worker() for _ in range(schedule.workers)]
        self.pending_backward = [{a.microbatch for a in acts if a.op is Op.BACKWARD} for acts in schedule.actions]
        self.channels: dict[tuple[int, int, bool], deque[tuple[int | None, float]]] = {}
        self.out_free = [0.0] * schedule.workers  # when each worker's link finishes sending its last message
        self.in_free = [0.0] * schedule.workers  # ... and receiving its last one
        self.shared_free: dict[tuple[bool, int, int], float] = {}  # (inwards, level, group): the same for groups
        self.arrived: dict[tuple[int, int], list[int]] = {}  # (stage, reduce index) -> workers there
        self.timeline: list[tuple[int, Action, float, float]] = []
        self.now = 0.0

    def run(self) -> None:
        while True:
            self._start_everything()
            running = [w for w in self.workers if w.state == "cpu"]
            delayed = [w for w in self.workers if w.state == "delay"]
            if not running and not delayed:
                return
            rate = 1.0 if self.cores is None else min(1.0, self.cores / max(len(running), 1))
            ends = [self.now + w.work / rate for w in running] + [w.until for w in delayed]
            step = min(ends) - self.now
            self.now += step
            for w in running:
                w.work = max(w.work - step * rate, 0.0)
            for i, w in enumerate(self.workers):
                if (w.state == "cpu" and w.work <= 1e-12 * max(self.now, 1.0)) or (
                    w.state == "delay" and w.until <= self.now
                ):
                    self._finish(i)

    def _start_everything(self) -> None:
        """Start the next action of every worker that can, until none can (actions of no time run at once)."""
        moved = True
        while moved:
            moved = False
            for i, w in enumerate(self.workers):
                if w.state in ("ready", "wait") and w.pc < len(self.schedule.actions[i]) and self._start(i):
                    moved = True

    def _start(self, i: int) -> bool:
        """Start worker ``i``'s next action if it can; False if it waits on a message or its replicas."""
        w, a = self.workers[i], self.schedule.actions[i][self.workers[i].pc]
        stage = self.stage[i]
        if a.op.is_recv:
            q = self.channels.get((a.to, i, a.op is Op.RECV_GRAD))
            if not q:
                w.state = "wait"
                return False
            mb, arrival = q[0]
            if mb != a.microbatch:
                raise ScheduleError(
                    f"worker {i} expects microbatch {a.microbatch} from worker {a.peer} ({a}) but the next message "
                    f"on that channel is microbatch {mb}: reorder the receives to match the sends\n"
                    + action_grid(self.schedule, {i: w.pc})
                )
            if arrival > self.now:
                w.state, w.until = "delay", arrival  # then it is taken: see _finish
                return True
            q.popleft()
            return self._use_core(i, self.recv_s)
        if a.op.is_send:
            return self._use_core(i, self.send_s)
        if a.op is Op.REDUCE_GRAD:
            there = self.arrived.setdefault((stage, w.reduces), [])
            if i not in there:
                there.append(i)
            if len(there) < self.replicas[stage]:
                w.state = "wait"
                return False
            w.started, w.state, w.until = self.now, "delay", self.now + self.costs[Op.REDUCE_GRAD][stage]
            return True
        w.started = self.now
        return self._use_core(i, self.costs[a.op][stage])

    def _use_core(self, i: int, seconds: float) -> bool:
        w = self.workers[i]
        w.started, w.state, w.work = self.now, "cpu", seconds
        if seconds <= 0:
            self._finish(i)
        return True

    def _shared_links(self, sender: int, receiver: int) -> list[tuple[bool, int, int]]:
        """The group links a message from ``sender`` to ``receiver`` crosses: out of the sender's group and into
        the receiver's, at every level where they differ."""
        if not self.groups:
            return []
        ours, theirs = self.groups[sender], self.groups[receiver]
        return [
            link
            for level, (a, b) in enumerate(zip(ours, theirs, strict=True))
            if a != b
            for link in ((False, level, a), (True, level, b))
        ]

    def _finish(self, i: int) -> None:
        """Worker ``i``'s current action ends now."""
        w, a = self.workers[i], self.schedule.actions[i][self.workers[i].pc]
        if a.op.is_recv and w.state == "delay":  # the message has just arrived: take it, then pay for it
            self.channels[(a.to, i, a.op is Op.RECV_GRAD)].popleft()
            self._use_core(i, self.recv_s)
            return
        if a.op.is_send:
            boundary = min(self.stage[i], self.stage[a.to])
            shared = self._shared_links(i, a.to)
            free = [self.out_free[i], self.in_free[a.to], *(self.shared_free.get(link, 0.0) for link in shared)]
            sent = max(self.now, *free) + self.hop[boundary]
            self.out_free[i] = self.in_free[a.to] = sent
            self.shared_free.update(dict.fromkeys(shared, sent))
            channel = self.channels.setdefault((i, a.to, a.op is Op.SEND_GRAD), deque())
            channel.append((a.microbatch, sent + self.delay[boundary]))
        elif not a.op.is_recv:
            self.timeline.append((i, a, w.started, self.now))
            w.busy += self.now - w.started
            w.reduces += a.op is Op.REDUCE_GRAD
            if a.op is Op.FORWARD and a.microbatch in self.pending_backward[i]:
                w.stashed.add(a.microbatch)
                w.peak = max(w.peak, len(w.stashed))
            elif a.op is Op.BACKWARD:
                w.stashed.discard(a.microbatch)
        w.pc += 1
        w.state, w.finished = "ready", self.now


def simulate(
    schedule: Schedule,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    *,
    transfer_s: float | Sequence[float] = 0.0,
    step_s: float | Sequence[float] = 0.0,
    reduce_s: float | Sequence[float] = 0.0,
    send_s: float = 0.0,
    recv_s: float = 0.0,
    cores: int | None = None,
    latency_s: float | Sequence[float] = 0.0,
    groups: Sequence[Sequence[int]] = (),
) -> SimResult:
    """Run ``schedule`` on a model of time and return its predicted timing and memory.

    Args:
        schedule: the action lists to run.
        forward_s: forward time of one microbatch, per stage (or one number for every stage).
        backward_s: backward time of one microbatch, per stage (or one number).
        transfer_s: time a message across the boundary after stage ``s`` keeps its sender's and its receiver's
            links busy (its bytes over the bandwidth), per boundary (``stages - 1`` values, or one number);
            activations and gradients take the same time.
        step_s: time of one optimizer step, per stage (or one number).
        reduce_s: time of one ``REDUCE`` once every replica has arrived (the all-reduce), per stage (or one
            number); it waits on the network, using no core.
        send_s: the sender's own time per message (the link's time comes after it).
        recv_s: the receiver's own time per message, once it has arrived.
        latency_s: time a message spends in flight after it leaves the link, per boundary (or one number):
            it delays the message without keeping the link from the next one.
        cores: the cores the workers share: forwards, backwards, steps, sends and receives use one, and when
            more workers want one than there are, they share them equally (processor sharing). ``None``:
            every worker has its own.
        groups: per worker, its group at each level above its own link (its server, then its rack, ...), whose link
            to the level above the group's workers share (``()``: none shared).

    Raises:
        DeadlockError: the workers wait on each other forever.
        ScheduleError: a receive gets a different microbatch than it expects, or a message is left unread.
    """
    n = schedule.stages
    costs = {
        Op.FORWARD: _per_item(forward_s, n, "forward_s"),
        Op.BACKWARD: _per_item(backward_s, n, "backward_s"),
        Op.REDUCE_GRAD: _per_item(reduce_s, n, "reduce_s"),
        Op.STEP: _per_item(step_s, n, "step_s"),
    }
    if cores is not None and cores < 1:
        raise InputError(f"cores must be at least 1, got {cores}")
    hop = _per_item(transfer_s, max(n - 1, 0), "transfer_s")
    delay = _per_item(latency_s, max(n - 1, 0), "latency_s")
    if min([*(c for values in costs.values() for c in values), *hop, *delay, send_s, recv_s]) < 0:
        raise InputError("times must be >= 0: a negative one would run the clock backwards")
    if groups and len(groups) != schedule.workers:
        raise InputError(f"groups needs one entry per worker ({schedule.workers}), got {len(groups)}")
    run = _Run(schedule, costs, hop=hop, delay=delay, send_s=send_s, recv_s=recv_s, cores=cores, groups=groups)
    run.run()
    stuck = [i for i, w in enumerate(run.workers) if w.pc < len(schedule.actions[i])]
    if stuck:
        where = "; ".join(f"worker {i} at {schedule.actions[i][run.workers[i].pc]}" for i in stuck)
        raise DeadlockError(
            f"deadlock: {where} wait for messages or replicas' reduces that never come\n"
            + action_grid(schedule, {i: run.workers[i].pc for i in stuck})
        )
    unread = [(k, len(q)) for k, q in run.channels.items() if q]
    if unread:
        (src, dst, grad), count = unread[0]
        kind = "gradient" if grad else "activation"
        raise ScheduleError(f"{count} {kind} message(s) from worker {src} to {dst} are sent but never received")
    finish = [w.finished for w in run.workers]
    return SimResult(
        max(finish, default=0.0), finish, [w.busy for w in run.workers], [w.peak for w in run.workers], run.timeline
    )
