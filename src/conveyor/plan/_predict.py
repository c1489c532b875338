"""How fast a plan runs: its schedule's action lists simulated with the costs the runtime pays.

Each forward and backward takes its layers' profiled time, each message its link's latency plus its
bytes over the bandwidth (and its sender's and receiver's own time), each ``REDUCE`` one ring all-reduce of
the stage's weights among all its replicas, as gloo and NCCL run it, at the slowest link the ring crosses
(the runtime does not overlap it with compute), each ``STEP`` the
layers' profiled optimizer step times what an update as the runtime makes it measured over that step
(:attr:`RuntimeCosts.update_factor`; on a stage that keeps weight versions, which copies them at each step,
:attr:`RuntimeCosts.stashed_update_factor`, and whose forwards run through a version, times
:attr:`RuntimeCosts.stashed_forward_factor`). On a machine with fewer cores than workers (:attr:`RuntimeCosts.cores`)
the workers that want a core at the same moment share them (the simulator's processor sharing): four
workers computing at once on two cores take twice as long, while one computing as the others wait on
the network does not.

What the prediction leaves out (each small where it was measured: docs/benchmarks/predictions.md,
plan-vs-run.md): every microbatch is charged the profiled microbatch's time, also a short or empty one at the
end of an epoch; the whole-model norm that synchronous schedules clip to is one more all-reduce per step.

Example (two layers without weights: data parallelism on both workers, 6 s per minibatch each):
    >>> from conveyor.plan._optimizer import optimize
    >>> p = Profile.chain("toy", [1.0, 1.0], [2.0, 2.0], [0, 0], [0, 0], batch_size=8)
    >>> t = Topology.parse("2:1e9")
    >>> plan = optimize(p, t)
    >>> plan.config, round(predict(plan, p, t, minibatches=8).samples_per_s, 3)
    ('2', 2.667)
    >>> round(predict(plan, p, t, minibatches=8, runtime=RuntimeCosts(cores=1)).samples_per_s, 3)  # one core
    1.333
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from conveyor.plan._cost_model import allreduce_s
from conveyor.plan._optimizer import Plan
from conveyor.plan._profiles import Profile
from conveyor.plan._topology import Topology
from conveyor.schedule import kind, make_schedule, simulate, stage_workers

__all__ = ["Prediction", "RuntimeCosts", "predict", "stage_times"]


@dataclass(frozen=True)
class Prediction:
    """The simulator's prediction for a run of ``minibatches`` minibatches (fill and drain included)."""

    minibatches: int
    seconds: float
    samples_per_s: float
    efficiency: float


def stage_times(plan: Plan, profile: Profile) -> tuple[list[float], list[float]]:
    """Per stage of ``plan``, the forward and the backward time of its layers on one worker."""
    layers = [profile.layers[st.first_layer : st.last_layer + 1] for st in plan.stages]
    return [sum(lay.forward_s for lay in ls) for ls in layers], [sum(lay.backward_s for lay in ls) for ls in layers]


@dataclass(frozen=True)
class RuntimeCosts:
    """What the runtime itself costs on a machine, beside the model's compute and the links' bytes (``conveyor
    train`` measures these at start-up; a plan made without them assumes none).

    Attributes:
        action_s: the executor's own time per compute action (forward, backward, reduce, step).
        send_s: a sender's own time per message (packing it, handing it to the transport).
        recv_s: a receiver's own time per message once it has arrived.
        allreduce_latency: seconds per step of a ring all-reduce (``None``: the topology's latency).
        allreduce_bandwidth: bytes per second of a ring all-reduce's steps (``None``: the topology's bandwidth).
        cores: the cores the workers share (``None``: every worker has its own).
        update_factor: what multiplies a ``STEP``'s profiled optimizer step: an update's local work as the runtime
            makes it (its ``REDUCE`` without the all-reduce, which is charged apart, and its ``STEP``) over that
            step, measured where an update divides the gradient sum by its samples (PipeDream's; an update that
            covers a batch skips that pass) after a backward has left the caches cold.
        stashed_update_factor: the same on a stage that keeps weight versions (each step's cloned, and measured
            extrapolated, as the stale-gradient correction does by default; without it the copy alone).
        stashed_forward_factor: a forward through a weight version (``functional_call``) over the module's own,
            on a stage that keeps versions.
    """

    action_s: float = 0.0
    send_s: float = 0.0
    recv_s: float = 0.0
    allreduce_latency: float | None = None
    allreduce_bandwidth: float | None = None
    cores: int | None = None
    update_factor: float = 1.0
    stashed_update_factor: float = 1.0
    stashed_forward_factor: float = 1.0


def predict(
    plan: Plan,
    profile: Profile,
    topology: Topology,
    minibatches: int | None = None,
    runtime: RuntimeCosts | None = None,
) -> Prediction:
    """Simulate ``plan``'s schedule for ``minibatches`` minibatches (default: about eight per worker) as the
    runtime runs it (see the module docstring). For a schedule with an update per batch the count is rounded
    up to whole batches of ``plan.microbatches``. ``profile`` is the one planned, in its own order."""
    runtime, profile = runtime or RuntimeCosts(), plan.in_order(profile)
    reps = plan.replicas
    unit = 1 if kind(plan.schedule).update == "round" else plan.microbatches
    batches = -(-(minibatches or 8 * plan.workers) // unit)
    forward, backward = stage_times(plan, profile)
    stashes = [kind(plan.schedule).stashes(reps, s) for s in range(len(reps))]
    forward = [f * runtime.stashed_forward_factor if kept else f for f, kept in zip(forward, stashes, strict=True)]
    if plan.recompute:  # the backward runs the forward again first
        backward = [b + f for f, b in zip(forward, backward, strict=True)]
    act = runtime.action_s
    ranks = stage_workers(reps)
    pairs = [(a[0], b[-1]) for a, b in itertools.pairwise(ranks)]
    links = [topology.level_between(*pair) for pair in pairs]
    transfer = [
        profile.cut_bytes(st.last_layer) / topology.bandwidth_between(*pair)
        for st, pair in zip(plan.stages, pairs, strict=False)
    ]
    reduce = []
    for st, workers in zip(plan.stages, ranks, strict=True):
        level = topology.level_between(workers[0], workers[-1])
        latency = level.latency if runtime.allreduce_latency is None else runtime.allreduce_latency
        ring = topology.bandwidth_between(workers[0], workers[-1])
        bandwidth = ring if runtime.allreduce_bandwidth is None else runtime.allreduce_bandwidth
        weights = profile.param_bytes(st.first_layer, st.last_layer + 1)
        reduce.append(act + allreduce_s(weights, st.replicas, latency, bandwidth))
    update = [runtime.stashed_update_factor if kept else runtime.update_factor for kept in stashes]
    step = [
        act + factor * sum(lay.step_s for lay in profile.layers[st.first_layer : st.last_layer + 1])
        for st, factor in zip(plan.stages, update, strict=True)
    ]
    result = simulate(
        make_schedule(plan.schedule, len(reps), unit, batches, reps),
        [f + act for f in forward],
        [b + act for b in backward],
        transfer_s=transfer,
        latency_s=[lv.latency for lv in links],
        step_s=step,
        reduce_s=reduce,
        send_s=runtime.send_s,
        recv_s=runtime.recv_s,
        cores=runtime.cores,
        groups=[topology.groups_of(worker) for worker in range(plan.workers)],
    )
    count, batch = batches * unit, profile.batch_size or 1
    return Prediction(count, result.step_s, count * batch / result.step_s, result.efficiency())
