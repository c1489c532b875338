"""The straggler modes: what each turns on, and one-line errors for bad ones."""

import pytest

from conveyor.stragglers import MODES, mode_settings


def test_each_mode_turns_on_its_mechanisms() -> None:
    assert {m: mode_settings(m, 3) for m in MODES} == {
        "flexrr": (3, True),
        "slack": (3, False),
        "reassign": (0, True),
        "off": (0, False),
    }
    assert mode_settings("reassign", 0) == (0, True)  # a slack it does not use need not be valid


@pytest.mark.parametrize(
    ("mode", "slack", "message"),
    [
        ("fast", 1, "unknown straggler mode 'fast': use one of flexrr, slack, reassign, off"),
        ("slack", 0, "--stragglers slack needs --slack of at least 1, got 0"),
    ],
)
def test_bad_modes_say_what_to_use(mode: str, slack: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        mode_settings(mode, slack)
