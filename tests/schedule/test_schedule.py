"""Schedule generators: complete, valid action lists with the stash each schedule promises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.schedule import (
    SCHEDULES,
    Op,
    Schedule,
    flush,
    forward_only,
    gpipe,
    make_schedule,
    pipedream,
    twobw,
    twobw_min_microbatches,
    validate,
)

sizes = given(stages=st.integers(1, 8), microbatches=st.integers(1, 12))


@sizes
def test_every_generator_makes_a_valid_schedule(stages: int, microbatches: int) -> None:
    for name in SCHEDULES:
        if name == "2bw" and microbatches < stages - 1:
            with pytest.raises(ValueError, match="use at least"):
                make_schedule(name, stages, microbatches, 3)
            continue
        validate(make_schedule(name, stages, microbatches, 3))
    validate(forward_only(stages, microbatches))


@given(
    replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    microbatches=st.integers(1, 7),
    steps=st.integers(1, 3),
)
def test_any_layout_and_counts_are_valid_and_route_each_microbatch_back_to_its_replica(
    replicas: list[int], microbatches: int, steps: int
) -> None:
    """No count needs to divide another: replica counts, microbatches per batch, batches per run."""
    for name in SCHEDULES:
        m = max(microbatches, twobw_min_microbatches(replicas)) if name == "2bw" else microbatches
        s = make_schedule(name, len(replicas), m, steps, replicas)
        validate(s)  # includes the replicas' all-reduce in its deadlock check
        assert s.replicas == tuple(replicas)
        for w, acts in enumerate(s.actions):
            stage = s.worker_stage[w]
            replica = w - s.worker_stage.index(stage)
            mine = {a.microbatch for a in acts if a.op is Op.FORWARD}
            assert mine == {k for k in range(s.microbatches) if k % replicas[stage] == replica}
            # Gradients go back to the worker that sent the activation.
            sent_to = {a.microbatch: a.peer for a in acts if a.op is Op.SEND_ACTIVATION}
            grads_from = {a.microbatch: a.peer for a in acts if a.op is Op.RECV_GRAD}
            assert sent_to == grads_from
            # Every replica joins every update of its stage, with or without a microbatch in it.
            updates = s.kind.updates(steps, m, replicas[stage])
            assert [a.op for a in acts].count(Op.REDUCE_GRAD) == [a.op for a in acts].count(Op.STEP) == updates


@sizes
def test_gpipe_stashes_every_microbatch(stages: int, microbatches: int) -> None:
    assert validate(gpipe(stages, microbatches)).peak_stashed == [microbatches] * stages


@sizes
def test_flush_stashes_at_most_stages_minus_index(stages: int, microbatches: int) -> None:
    peaks = validate(flush(stages, microbatches)).peak_stashed
    assert peaks == [min(stages - s, microbatches) for s in range(stages)]


def test_flush_is_one_forward_one_backward_in_steady_state() -> None:
    compute = [str(a) for a in flush(4, 8).actions[1] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert compute[:6] == ["F0", "F1", "F2", "B0", "F3", "B1"]
    assert compute[-3:] == ["B5", "B6", "B7"]


def test_gpipe_runs_all_forwards_before_any_backward() -> None:
    ops = [a.op for a in gpipe(3, 4).actions[2] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert ops == [Op.FORWARD] * 4 + [Op.BACKWARD] * 4


def test_training_schedules_end_with_a_step_and_reduce_before_every_step() -> None:
    for name in SCHEDULES:
        s = make_schedule(name, 3, 4, steps=2, replicas=[2, 1, 1])
        for w, acts in enumerate(s.actions):
            ops = [a.op for a in acts]
            assert ops[-2:] == [Op.REDUCE_GRAD, Op.STEP]
            steps = [i for i, op in enumerate(ops) if op is Op.STEP]
            assert all(ops[i - 1] is Op.REDUCE_GRAD for i in steps)
            per_worker = 8 // s.replicas[s.worker_stage[w]]
            expected = per_worker if name.startswith("pipedream") else 2  # PipeDream updates per round
            assert len(steps) == expected, (name, w)


def test_a_replica_without_microbatches_in_a_batch_only_reduces_and_steps() -> None:
    s = flush(2, 2, steps=2, replicas=[3, 1])  # microbatches 0..3 on replicas 0, 1, 2, 0
    assert " ".join(map(str, s.actions[2])) == "REDUCE STEP F2 SEND_F2>3 RECV_B2<3 B2 REDUCE STEP"
    assert " ".join(map(str, s.actions[1])) == "F1 SEND_F1>3 RECV_B1<3 B1 REDUCE STEP REDUCE STEP"


def test_pipedream_admits_noam_minibatches_and_stashes_fewer_versions_downstream() -> None:
    s = pipedream(4, 8)
    first = [str(a) for a in s.actions[0] if a.op in (Op.FORWARD, Op.BACKWARD, Op.STEP)]
    assert first[:7] == ["F0", "F1", "F2", "F3", "B0", "STEP", "F4"]
    assert s.peak_versions() == [4, 3, 2, 1]
    # NOAM = ceil(workers / input replicas): 5 workers, 2 on the input stage -> 3 forwards before a backward.
    r = pipedream(3, 12, replicas=[2, 2, 1])
    ops = [a.op for a in r.actions[0] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert ops[:4] == [Op.FORWARD] * 3 + [Op.BACKWARD]


def test_pipedream_forward_uses_the_version_after_its_stages_backwards() -> None:
    """On stage s the forward of minibatch k uses W(max(0, k - (p - 1 - s))), the staleness PipeDream states."""
    p = 4
    s = pipedream(p, 10)
    for w in range(p):
        assert s.forward_versions(w) == {k: max(0, k - (p - 1 - w)) for k in range(10)}


def test_vertical_sync_uses_the_input_stage_version_everywhere() -> None:
    p = 4
    s = pipedream(p, 10, vertical_sync=True)
    for w in range(p):
        assert s.forward_versions(w) == {k: max(0, k - (p - 1)) for k in range(10)}
    assert s.peak_versions() == [4, 4, 4, 4]
    # Replicated: the input stage steps once per 2 minibatches, stage 1 once per minibatch.
    r = pipedream(2, 8, replicas=[2, 1], vertical_sync=True)
    entered = {**r.forward_versions(0), **r.forward_versions(1)}
    assert r.forward_versions(2) == {k: 2 * v for k, v in entered.items()}


def test_twobw_is_one_stale_on_every_stage_with_two_versions() -> None:
    s = twobw(4, 4, steps=5)
    for w in range(4):
        assert s.forward_versions(w) == {k: max(0, k // 4 - 1) for k in range(20)}
    assert s.peak_versions() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="use at least 3 microbatches per step"):
        twobw(4, 2, steps=3)


def test_flush_schedules_keep_one_weight_version() -> None:
    for name in ("gpipe", "flush"):
        assert make_schedule(name, 4, 8, steps=3).peak_versions() == [1] * 4


def test_replicas_must_give_every_stage_a_worker() -> None:
    with pytest.raises(ValueError, match="each of the 2 stages a count >= 1"):
        flush(2, 4, replicas=[1])


def test_json_round_trip() -> None:
    s = flush(4, 8)
    assert Schedule.from_json(s.to_json()) == s


def test_json_round_trip_keeps_versions_and_replicas() -> None:
    s = twobw(3, 6, steps=2, replicas=[2, 1, 3])
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize(("stages", "microbatches"), [(0, 4), (2, 0)])
def test_bad_sizes_are_rejected(stages: int, microbatches: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        gpipe(stages, microbatches)
