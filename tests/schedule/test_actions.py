"""Actions print and parse as the short text schedules are shown in."""

import pytest

from conveyor.schedule import Action, Op


@pytest.mark.parametrize("text", ["F0", "B12", "SEND_F3>1", "RECV_B2<3", "STEP", "REDUCE", "SEND_B0>0", "F7@2"])
def test_action_text_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_parsed_fields() -> None:
    assert Action.parse("RECV_F4<2") == Action(Op.RECV_ACTIVATION, 4, 2)
    assert Action.parse("REDUCE") == Action(Op.REDUCE_GRAD)
    assert Action.parse("F5@1").version == 1


@pytest.mark.parametrize("text", ["X3", "Fx", "STEPx", "RECV_B2<y", "F1@z"])
def test_bad_action_text_is_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse(text)


def test_step_and_reduce_have_no_microbatch() -> None:
    assert Action(Op.STEP).microbatch is None and Action.parse("REDUCE").microbatch is None
