"""Schedule generators: complete, valid action lists with the stash each schedule promises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.schedule._schedule import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    flush,
    forward_only,
    gpipe,
    make_schedule,
    pipedream,
    twobw,
)
from conveyor.schedule._validate import validate

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


@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4), steps=st.integers(1, 3))
def test_replicated_layouts_are_valid_and_route_each_microbatch_back_to_its_replica(
    replicas: list[int], steps: int
) -> None:
    microbatches = 6 * max(replicas)  # a multiple of every replica count, and enough for 2BW
    for name in SCHEDULES:
        s = make_schedule(name, len(replicas), microbatches, steps, replicas)
        validate(s)  # includes the replicas' step all-reduce in its deadlock check
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
        for w in range(s.workers):  # replicas of a stage step the same number of times
            steps_of = {
                sum(a.op is Op.STEP for a in acts)
                for x, acts in enumerate(s.actions)
                if s.worker_stage[x] == s.worker_stage[w]
            }
            assert len(steps_of) == 1


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


def test_training_schedules_end_with_a_step_and_step_as_often_as_their_updates() -> None:
    for name in SCHEDULES:
        s = make_schedule(name, 3, 4, steps=2, replicas=[2, 1, 1])
        for w, acts in enumerate(s.actions):
            assert acts[-1].op is Op.STEP
            per_worker = 8 // s.replicas[s.worker_stage[w]]
            expected = per_worker if name.startswith("pipedream") else 2  # PipeDream updates per minibatch
            assert [a.op for a in acts].count(Op.STEP) == expected, (name, w)
        sizes = [s.update_size(stage) for stage in range(3)]
        assert sizes == ([2, 1, 1] if name.startswith("pipedream") else [4, 4, 4]), name


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


def test_replicas_must_fit_the_stages_and_share_the_microbatches() -> None:
    with pytest.raises(ValueError, match="each of the 2 stages a count >= 1"):
        flush(2, 4, replicas=[1])
    with pytest.raises(ValueError, match="use a multiple of 6"):
        flush(2, 4, replicas=[3, 2])


def test_json_round_trip() -> None:
    s = flush(4, 8)
    assert Schedule.from_json(s.to_json()) == s


def test_json_round_trip_keeps_versions_and_replicas() -> None:
    s = twobw(3, 6, steps=2, replicas=[2, 1, 3])
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("text", ["F0", "B12", "SEND_F3>1", "RECV_B2<3", "STEP", "SEND_B0>0", "F7@2"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_bad_action_text_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("X3")


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of 2bw, flush, gpipe, pipedream, pipedream-vs"):
        make_schedule("zigzag", 2, 2)


@pytest.mark.parametrize(("stages", "microbatches"), [(0, 4), (2, 0)])
def test_bad_sizes_are_rejected(stages: int, microbatches: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        gpipe(stages, microbatches)
