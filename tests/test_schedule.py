"""Schedule generators: complete, valid action lists with the stash each schedule promises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conveyor.schedule import SCHEDULES, Action, Op, Schedule, flush, forward_only, gpipe, make_schedule
from conveyor.validate import validate

sizes = given(stages=st.integers(1, 8), microbatches=st.integers(1, 12))


@sizes
def test_every_generator_makes_a_valid_schedule(stages: int, microbatches: int) -> None:
    for name in SCHEDULES:
        validate(make_schedule(name, stages, microbatches))
    validate(forward_only(stages, microbatches))


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


def test_training_schedules_end_with_one_step() -> None:
    for name in SCHEDULES:
        for acts in make_schedule(name, 3, 4).actions:
            assert [a.op for a in acts].count(Op.STEP) == 1 and acts[-1].op is Op.STEP


def test_json_round_trip() -> None:
    s = flush(4, 8)
    assert Schedule.from_json(s.to_json()) == s


@pytest.mark.parametrize("text", ["F0", "B12", "SEND_F3>1", "RECV_B2<3", "STEP", "SEND_B0>0"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_bad_action_text_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("X3")


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of flush, gpipe"):
        make_schedule("zigzag", 2, 2)


@pytest.mark.parametrize(("stages", "microbatches"), [(0, 4), (2, 0)])
def test_bad_sizes_are_rejected(stages: int, microbatches: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        gpipe(stages, microbatches)
