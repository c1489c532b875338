"""The straggler modes: what each turns on, and one-line errors for bad ones."""

import pytest

from conveyor.config import MODES, mode_settings


def test_each_mode_turns_on_its_mechanisms() -> None:
    assert {m: tuple(mode_settings(m, 3)) for m in MODES} == {
        "live": (0, True, True, True),  # reduced among the replicas whose runs were used: synchronous
        "flexrr": (3, True, False, False),
        "slack": (3, False, False, False),
        "reassign": (0, True, False, False),
        "backup": (0, True, True, False),  # synchronous: a replica running ahead would not wait to back a chunk up
        "off": (0, False, False, False),
    }
    assert mode_settings("reassign", 0) == (0, True, False, False)  # a slack it does not use need not be valid
    assert mode_settings("backup", 0).backup


@pytest.mark.parametrize(
    ("mode", "slack", "message"),
    [
        ("fast", 1, "unknown straggler mode 'fast': use one of live, flexrr, slack, reassign, backup, off"),
        ("slack", 0, "--stragglers slack needs --slack of at least 1, got 0"),
    ],
)
def test_bad_modes_say_what_to_use(mode: str, slack: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        mode_settings(mode, slack)
