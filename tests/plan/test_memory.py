"""Per-worker bytes: weight versions, a gradient buffer, optimizer state and the stash (the counts
themselves are checked against the action lists in tests/schedule/test_kinds.py)."""

import pytest

from conveyor.plan._memory import in_flight, stage_bytes
from conveyor.plan._profiles import Layer, Profile


def test_stage_bytes_adds_versions_gradients_optimizer_and_stash() -> None:
    layers = (Layer("a", "", 0.0, 0.0, 7, 100, 30, 200), Layer("b", "", 0.0, 0.0, 7, 10, 3, 20))
    p = Profile("m", layers, ((0, 1),))
    # PipeDream, one replica, 3 workers from here on: 3 versions + 1 gradient of 110 B, 220 B of optimizer
    # state, 3 microbatches of 33 B saved.
    assert (
        stage_bytes(p, first=0, stop=2, schedule="pipedream", replicas=1, downstream=3, microbatches=8)
        == 4 * 110 + 220 + 3 * 33
    )
    assert (
        stage_bytes(p, first=0, stop=2, schedule="gpipe", replicas=2, downstream=3, microbatches=8)
        == 2 * 110 + 220 + 4 * 33
    )


def test_output_bytes_stand_in_when_saved_bytes_were_not_measured() -> None:
    p = Profile.chain("m", forward_s=[0.0, 0.0], backward_s=[0.0, 0.0], output_bytes=[5, 6], param_bytes=[0, 0])
    assert stage_bytes(p, first=0, stop=2, schedule="flush", replicas=1, downstream=1, microbatches=4) == 11


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="pipedream, 2bw, flush, gpipe"):
        in_flight("zero-bubble", 1, 1, 1)
