"""Predictions: a plan's schedule simulated with the runtime's costs, the cores shared as they are."""

from dataclasses import replace

import pytest

from conveyor.plan import Plan, PlannedStage, Profile, RuntimeCosts, Topology, allreduce_s, predict

# Two layers of 1 s forward and 2 s backward, 8 samples a microbatch, 100 MB of weights each, 4 MB between.
PROFILE = Profile.chain(
    "two",
    forward_s=[1.0, 1.0],
    backward_s=[2.0, 2.0],
    output_bytes=[4e6, 4e6],
    param_bytes=[10**8, 10**8],
    batch_size=8,
)


def _plan(replicas: list[int], schedule: str = "flush", microbatches: int = 4) -> Plan:
    if len(replicas) == 1:
        stages = (PlannedStage(0, 1, replicas[0], 0.0),)
    else:
        stages = (PlannedStage(0, 0, replicas[0], 0.0), PlannedStage(1, 1, replicas[1], 0.0))
    return Plan(stages, 0.0, 0.0, 0.0, schedule, microbatches)


def test_ring_allreduce() -> None:
    assert allreduce_s(1e9, 1, 0.1, 1e9) == 0.0
    assert allreduce_s(1e9, 4, 0.1, 1e9) == pytest.approx(6 * (0.1 + 0.25))


def test_data_parallelism_pays_a_blocking_allreduce_per_batch() -> None:
    topology = Topology.parse("2:1e9/10ms")
    # Per batch of 4 microbatches: 2 each per replica (6 s each), then the all-reduce of 200 MB: 2 (0.01 + 0.1).
    seconds = predict(_plan([2]), PROFILE, topology, minibatches=4).seconds
    assert seconds == pytest.approx(2 * 6.0 + 2 * (0.01 + 0.1))


def test_messages_cost_latency_bytes_and_their_ends() -> None:
    topology = Topology.parse("2:1e9/10ms")
    plan = _plan([1, 1], microbatches=1)
    bare = predict(plan, PROFILE, topology, minibatches=1).seconds
    # One microbatch: 3 s per stage, and an activation and a gradient of 4 MB at 10 ms + 4 ms each.
    assert bare == pytest.approx(6.0 + 2 * 0.014)
    ends = predict(plan, PROFILE, topology, minibatches=1, runtime=RuntimeCosts(send_s=0.5, recv_s=0.25))
    assert ends.seconds == pytest.approx(bare + 2 * 0.75)


def test_a_servers_replicas_share_its_link_to_the_other_server() -> None:
    # Two replicas per stage, the stages on two servers: each activation (4 MB) crosses at 1e6 bytes/s, 4 s. On
    # links of their own (one level) two cross at once; through a server's link to the other, one at a time.
    plan = _plan([2, 2], microbatches=2)
    own = predict(plan, PROFILE, Topology.parse("4:1e6"), minibatches=2).seconds
    shared = predict(plan, PROFILE, Topology.parse("2:1e6,2:1e6"), minibatches=2).seconds
    assert shared == pytest.approx(own + 4.0)  # the second activation waits 4 s; the gradients, as far apart, do not


def test_runtime_costs_per_action_and_shared_cores() -> None:
    topology = Topology.parse("4:1e12")
    plan = _plan([4])
    alone = predict(plan, PROFILE, topology, minibatches=4).seconds
    allreduce = allreduce_s(2e8, 4, 0.0, 1e12)  # on the network: it does not share the cores
    assert predict(plan, PROFILE, topology, 4, RuntimeCosts(cores=2)).seconds == pytest.approx(2 * alone - allreduce)
    # Each replica runs a forward, a backward, a reduce and a step: four actions of 0.25 s more.
    assert predict(plan, PROFILE, topology, 4, RuntimeCosts(action_s=0.25)).seconds == pytest.approx(alone + 1.0)


def _with_steps(steps: list[float]) -> Profile:
    return replace(PROFILE, layers=tuple(replace(lay, step_s=s) for lay, s in zip(PROFILE.layers, steps, strict=True)))


def _first_forward_times(profile: Profile, factor: float) -> Profile:
    first, *rest = profile.layers
    return replace(profile, layers=(replace(first, forward_s=first.forward_s * factor), *rest))


@pytest.mark.parametrize("schedule", ["pipedream", "flush"])
def test_a_stage_that_keeps_versions_pays_for_them_in_its_updates_and_forwards(schedule: str) -> None:
    topology = Topology.parse("2:1e9/10ms")
    plan = _plan([1, 1], schedule)
    runtime = RuntimeCosts(update_factor=2.0, stashed_update_factor=3.0, stashed_forward_factor=1.5)
    measured = predict(plan, _with_steps([0.5, 0.5]), topology, minibatches=8, runtime=runtime).seconds
    # PipeDream's first stage keeps a weight version per microbatch in flight, its last stage none; flush none.
    pipedream = schedule == "pipedream"
    same = _with_steps([0.5 * (3.0 if pipedream else 2.0), 0.5 * 2.0])
    same = _first_forward_times(same, 1.5) if pipedream else same
    assert measured == pytest.approx(predict(plan, same, topology, minibatches=8).seconds)
    assert measured > predict(plan, _with_steps([0.5, 0.5]), topology, minibatches=8).seconds
