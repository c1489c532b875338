"""What the runtime itself costs on this machine: a message between two workers, an all-reduce among all of
them, the executor's own time per action and an update as it makes it. ``conveyor train`` measures these at
start-up, with the cores as busy as in the run, and plans and predicts with them.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.runtime._devices import default_device, synchronize
from conveyor.runtime._executor import Executor, LossFn
from conveyor.runtime._feed import BatchSource
from conveyor.runtime._solo import lone_updater
from conveyor.runtime._transport import P2P
from conveyor.runtime._versions import WeightVersions
from conveyor.schedule import KINDS, Action, Batches, Op, worker_actions

__all__ = ["MeasuredLink", "UpdateTimes", "measure_allreduce", "measure_link", "measure_overhead", "measure_updates"]


@dataclass(frozen=True)
class MeasuredLink:
    """Messages between two workers as the runtime sends them: a message of ``b`` bytes costs its sender
    ``send_s``, then takes ``latency + b / bandwidth`` to arrive, then costs its receiver ``recv_s``."""

    send_s: float
    recv_s: float
    latency: float
    bandwidth: float


# A noisy host can make the big message no slower than the small one: the bytes are then taken to cost a
# microsecond, so a measurement of loopback never reads as faster than any real link.
_SHORTEST_S = 1e-6


def measure_link(
    p2p: P2P,
    peer: int,
    *,
    leader: bool,
    nbytes: int = 1 << 22,
    repeats: int = 20,
    busy: Callable[[], object] | None = None,
) -> MeasuredLink:
    """Measure :class:`MeasuredLink` to and from ``peer``; both workers call it, one as the leader (whose result
    holds; the follower's holds its own send times only).

    A ping-pong of 4-byte messages gives the round trip (two messages, each one send, one transfer and one
    receive); the leader's send calls give ``send_s`` (medians throughout: a preempted call is not the
    cost of a message); a burst the follower receives only after it has surely arrived gives ``recv_s``;
    what a ping-pong of ``nbytes`` messages takes beyond the 4-byte one gives the bandwidth. With ``busy``
    (a piece of work, such as a forward and backward), each side runs it before each of its sends, as a
    pipeline stage computes between messages: the latency then includes waking a worker on cores that
    others keep busy (the work's own time is taken out).
    """
    small, big = torch.zeros(1, device=p2p.device), torch.zeros(nbytes // 4, device=p2p.device)

    def ping_pong(tree: torch.Tensor, count: int, work: Callable[[], object] | None) -> tuple[float, float]:
        """Seconds per message, without the work's time on either side, and the leader's mean send time."""
        sends, worked = [], 0.0
        start = time.perf_counter()
        for _ in range(count):
            if not leader:
                p2p.recv_tree(peer)
            if work is not None:
                began = time.perf_counter()
                work()
                worked += time.perf_counter() - began
            began = time.perf_counter()
            p2p.send_tree(tree, peer)
            sends.append(time.perf_counter() - began)
            if leader:
                p2p.recv_tree(peer)
        p2p.wait_sends()
        elapsed = time.perf_counter() - start
        worked += _exchange(p2p, peer, leader, worked)  # the follower's work is inside the leader's round trips
        return (elapsed - worked) / (2 * count), statistics.median(sends)

    ping_pong(small, 3, None)  # warm-up: connections, the messages' structure
    idle, send_s = ping_pong(small, repeats, None)
    per_message = ping_pong(small, repeats, busy)[0] if busy is not None else idle
    recv_s = _receive_cost(p2p, peer, leader, small, repeats)
    ping_pong(big, 2, None)
    big_message, _ = ping_pong(big, max(repeats // 4, 3), None)
    latency = max(per_message - send_s - recv_s, 0.0)
    bandwidth = nbytes / max(big_message - idle, _SHORTEST_S)  # what the bytes add to a message, on idle cores
    return MeasuredLink(send_s, recv_s, latency, bandwidth)


def _receive_cost(p2p: P2P, peer: int, leader: bool, tree: torch.Tensor, repeats: int) -> float:
    """A burst the follower receives only after it has surely all arrived, so its receives measure only their
    own cost (the median, on the leader)."""
    receives = []
    if leader:
        for _ in range(repeats):
            p2p.send_tree(tree, peer)
        p2p.wait_sends()
        p2p.recv_tree(peer)
    else:
        time.sleep(0.05)
        for _ in range(repeats):
            began = time.perf_counter()
            p2p.recv_tree(peer)
            receives.append(time.perf_counter() - began)
        p2p.send_tree(tree, peer)
        p2p.wait_sends()
    return _exchange(p2p, peer, leader, statistics.median(receives) if receives else 0.0)


def _exchange(p2p: P2P, peer: int, leader: bool, value: float) -> float:
    """The follower's ``value`` on the leader; 0 on the follower (which sends it)."""
    if leader:
        return float(p2p.recv_tree(peer)[0])
    p2p.send_tree(torch.tensor(value, dtype=torch.float64), peer)
    p2p.wait_sends()
    return 0.0


def measure_allreduce(
    nbytes: int = 1 << 22, repeats: int = 10, busy: Callable[[], object] | None = None
) -> tuple[float, float]:
    """Seconds per step and bytes per second of a ring all-reduce among all workers (every worker calls it):
    an all-reduce of ``b`` bytes among ``r`` workers takes ``2 (r - 1) (latency + b / r / bandwidth)``.

    With ``busy`` (a piece of work, such as a forward and backward), every worker runs it before each
    all-reduce, as training does: the time then includes waiting for the replica that finished last and
    waking peers on cores that other workers keep busy, which on a machine with fewer cores than workers
    costs far more than the messages themselves.
    """
    world = dist.get_world_size()
    steps = 2 * (world - 1)

    def seconds(t: torch.Tensor) -> float:
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        times = []
        for _ in range(repeats):
            if busy is not None:
                busy()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    device = default_device()  # NCCL reduces only tensors on the GPU
    latency = seconds(torch.zeros(1, device=device)) / steps
    per_step = seconds(torch.zeros(nbytes // 4, device=device)) / steps
    return latency, nbytes / world / max(per_step - latency, _SHORTEST_S)


def measure_overhead(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    *,
    loss_fn: LossFn,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    microbatches: int,
    compute_s: float,
    device: torch.device,
    fastest: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple[float, float]:
    """The executor's own time per compute action (forward, backward, reduce, step): a copy of the whole model
    runs as one stage of a flush schedule on ``batches`` (the first one a warm-up), and what its time per batch
    exceeds ``compute_s`` (the profiled forwards, backwards and optimizer step of one batch) is shared among the
    batch's ``2 m + 2`` actions. The median batch counts, or with ``fastest`` the fastest one (on a device that
    runs in bursts, as a CPU quota does, the fastest batch is the one no stop fell into). ``autocast``: the
    forwards' dtype, as the pipeline's. On CUDA each batch ends with a synchronisation, so its time is the
    device's.

    Returns:
        The seconds per action, and the seconds of the batch they were taken from.
    """
    executor = _lone_executor(model, loss_fn=loss_fn, optimizer=optimizer, device=device, autocast=autocast)
    times = []
    for batch in batches:
        start = time.perf_counter()
        _run_batch(executor, batch, "flush", microbatches, device)
        times.append(time.perf_counter() - start)
    per_batch = min(times[1:]) if fastest else statistics.median(times[1:])
    return max(0.0, (per_batch - compute_s) / (2 * microbatches + 2)), per_batch


@dataclass(frozen=True)
class UpdateTimes:
    """What the executor's updates and forwards take on a copy of the whole model, without weight versions and on a
    stage that keeps them (:func:`measure_updates`; seconds, medians).

    Attributes:
        update_s: an update, its ``REDUCE`` and ``STEP``.
        stashed_update_s: the same where each step's version is cloned and extrapolated over one step.
        forward_s: a microbatch's forward through the module itself.
        stashed_forward_s: the same through a weight version (``functional_call`` on the version's tensors).
    """

    update_s: float
    stashed_update_s: float
    forward_s: float
    stashed_forward_s: float


def measure_updates(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    *,
    loss_fn: LossFn,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    microbatches: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
) -> UpdateTimes:
    """Updates and forwards as the executor runs them (an update's ``REDUCE`` and ``STEP`` right after a backward),
    on a copy of the whole model as one stage of PipeDream's schedule (an update per microbatch, the gradient sum
    divided by its samples), once without weight versions and once with them, each step's version cloned and
    extrapolated over one step (a stale stage's, with the stale-gradient correction:
    :class:`~conveyor.runtime._versions.WeightVersions`), each forward then through its version. Beside a profile's
    optimizer step, timed on its own over weights already in the caches, these count what the run adds: the caches
    the backward left cold, the division, the gradients freed, the versions' copies and calls. The two take turns,
    batch by batch; the first batch is a warm-up. On CUDA these are the host's times (an action issues its kernels
    without waiting for them), as the profile's step is."""
    executor = _lone_executor(
        model, loss_fn=loss_fn, optimizer=optimizer, device=device, autocast=autocast, averaged=False
    )  # one copy for both: a run starts its weight versions afresh
    updates: dict[bool, list[float]] = {False: [], True: []}
    forwards: dict[bool, list[float]] = {False: [], True: []}
    for index, batch in enumerate(batches):
        for stashing in (False, True):  # batch by batch, so that the machine's drift hits both
            executor.trace = []
            _run_batch(executor, batch, "pipedream", microbatches, device, stashing=stashing)
            if index:
                reduces, steps = _seconds(executor.trace, Op.REDUCE_GRAD), _seconds(executor.trace, Op.STEP)
                updates[stashing] += [r + s for r, s in zip(reduces, steps, strict=True)]
                forwards[stashing] += _seconds(executor.trace, Op.FORWARD)
    median = statistics.median
    return UpdateTimes(
        update_s=median(updates[False]),
        stashed_update_s=median(updates[True]),
        forward_s=median(forwards[False]),
        stashed_forward_s=median(forwards[True]),
    )


def _run_batch(
    executor: Executor, batch: Any, schedule: str, microbatches: int, device: torch.device, *, stashing: bool = False
) -> None:
    """Train ``executor``'s one stage of one worker on ``batch`` with ``schedule``'s actions, to the device's end;
    ``stashing``: on weight versions, each extrapolated over one step."""
    source = BatchSource([batch], microbatches, True, True, worker=0)
    actions = worker_actions(KINDS[schedule], 0, [1], microbatches, Batches(1))
    executor.run(actions, source, training=True, stashing=stashing, predict=int(stashing))
    synchronize(device)


def _seconds(trace: list[tuple[Action, float, float]], op: Op) -> list[float]:
    """The seconds of each ``op`` action in an executor's trace, in order."""
    return [end - start for action, start, end in trace if action.op == op]


def _lone_executor(
    model: nn.Module,
    *,
    loss_fn: LossFn,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device,
    autocast: torch.dtype | None,
    averaged: bool = True,
) -> Executor:
    """An executor of a copy of ``model`` on ``device`` as the one stage of one worker, with an optimizer of its own
    (:func:`~conveyor.runtime._solo.lone_updater`)."""
    module = copy.deepcopy(model).to(device)
    return Executor(
        module,
        stage=0,
        stages=1,
        rank_of_worker=[0],
        p2p=P2P(device),
        loss_fn=loss_fn,
        device=device,
        weights=WeightVersions(module),
        updater=lone_updater(module, optimizer, device, averaged=averaged),
        autocast=autocast,
    )
