"""The validator rejects schedules that cannot run: deadlocks, bad order, unmatched messages, stash."""

import dataclasses

import pytest

from conveyor.schedule import Action, DeadlockError, Schedule, ScheduleError, flush, gpipe, pipedream, validate


def _replace_worker(s: Schedule, worker: int, actions: list[str]) -> Schedule:
    acts = list(s.actions)
    acts[worker] = tuple(Action.parse(a) for a in actions)
    return dataclasses.replace(s, actions=tuple(acts))


def test_accepts_the_generated_schedules() -> None:
    validate(flush(3, 5), max_stashed=3)
    validate(gpipe(3, 5), max_stashed=5)


def test_rejects_a_deadlocking_order() -> None:
    # Stage 0 waits for the gradient of microbatch 0 before sending microbatch 0's activation:
    # stage 1 waits for that activation, stage 0 for stage 1's gradient. Neither moves.
    s = _replace_worker(gpipe(2, 1), 0, ["F0", "RECV_B0<1", "SEND_F0>1", "B0", "REDUCE", "STEP"])
    with pytest.raises(DeadlockError, match="deadlock"):
        validate(s)


def test_rejects_receives_in_another_order_than_the_sends() -> None:
    s = _replace_worker(
        flush(2, 2), 1, ["RECV_F1<0", "F1", "B1", "SEND_B1>0", "RECV_F0<0", "F0", "B0", "SEND_B0>0", "REDUCE", "STEP"]
    )
    with pytest.raises(ScheduleError, match=r"expects microbatch 1 .* next message on that channel is microbatch 0"):
        validate(s)


def test_rejects_a_send_nobody_receives() -> None:
    s = _replace_worker(gpipe(2, 1), 0, ["F0", "SEND_F0>1", "SEND_F0>1", "RECV_B0<1", "B0", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError, match="never received"):
        validate(s)


def test_rejects_a_backward_before_its_forward() -> None:
    s = _replace_worker(gpipe(1, 2), 0, ["F0", "B1", "F1", "B0", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError, match="comes before the forward of microbatch 1"):
        validate(s)


def test_rejects_a_forward_without_its_input() -> None:
    s = _replace_worker(gpipe(2, 1), 1, ["F0", "RECV_F0<0", "B0", "SEND_B0>0", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError, match="comes before the recv activation of microbatch 0"):
        validate(s)


def test_rejects_a_microbatch_run_twice_or_never() -> None:
    s = _replace_worker(gpipe(1, 2), 0, ["F0", "F0", "B0", "B1", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError, match="forward of microbatch 0 2 times"):
        validate(s)


def test_rejects_a_training_schedule_without_a_step() -> None:
    s = _replace_worker(gpipe(1, 1), 0, ["F0", "B0"])
    with pytest.raises(ScheduleError, match="must end with an optimizer step"):
        validate(s)


def test_rejects_a_peer_on_the_wrong_stage() -> None:
    s = _replace_worker(gpipe(3, 1), 0, ["F0", "SEND_F0>2", "RECV_B0<1", "B0", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError, match="peer must run stage 1"):
        validate(s)


def test_enforces_the_stash_bound() -> None:
    with pytest.raises(ScheduleError, match="stashes 4 activations at once, more than its bound 2"):
        validate(gpipe(2, 4), max_stashed=2)
    validate(flush(2, 4), max_stashed=[2, 1])


def test_rejects_a_step_without_a_reduce() -> None:
    s = _replace_worker(gpipe(1, 1), 0, ["F0", "B0", "STEP"])
    with pytest.raises(ScheduleError, match="an optimizer step must follow a REDUCE"):
        validate(s)


def test_rejects_replicas_that_reduce_unequally() -> None:
    s = flush(1, 2, replicas=[2])
    with pytest.raises(ScheduleError, match="replicas of stage 0 reduce a different number of times"):
        validate(_replace_worker(s, 1, ["F1", "B1", "REDUCE", "STEP", "REDUCE", "STEP"]))


def test_errors_show_the_action_grid_with_the_failing_action_marked() -> None:
    s = _replace_worker(gpipe(2, 1), 1, ["F0", "RECV_F0<0", "B0", "SEND_B0>0", "REDUCE", "STEP"])
    with pytest.raises(ScheduleError) as info:
        validate(s)
    lines = str(info.value).splitlines()
    assert lines[1] == "  worker 0 (stage 0): F0 SEND_F0>1 RECV_B0<1 B0 REDUCE STEP"
    assert lines[2] == "  worker 1 (stage 1): >>F0<< RECV_F0<0 B0 SEND_B0>0 REDUCE STEP"


def test_rejects_a_forward_on_a_version_not_made_yet() -> None:
    s = pipedream(2, 2)
    acts = [str(a) for a in s.actions[1]]
    acts[acts.index("F0")] = "F0@1"
    with pytest.raises(ScheduleError, match=r"uses weight version 1, but only versions 0\.\.0 exist yet"):
        validate(_replace_worker(s, 1, acts))


def test_replicas_that_reduce_out_of_turn_deadlock() -> None:
    # Replica 0 of stage 0 reduces (an all-reduce with replica 1) before sending its first activation, which
    # stage 1 needs before it can return replica 1's gradient: each waits on the other.
    s = flush(2, 4, steps=2, replicas=[2, 1])
    acts = [str(a) for a in s.actions[0]]
    first_reduce = acts.index("REDUCE")
    acts[:0] = [acts.pop(first_reduce), acts.pop(first_reduce)]  # REDUCE, STEP first
    with pytest.raises(DeadlockError, match="replicas' reduces") as info:
        validate(_replace_worker(s, 0, acts))
    assert "worker 0 (stage 0): >>REDUCE<<" in str(info.value)
