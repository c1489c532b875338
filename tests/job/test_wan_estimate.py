"""--wan-estimate auto in a run: a pilot decides before training, the checkpoint keeps the choice, and a run resumed
from it takes that choice without trying again."""

from pathlib import Path

import pytest
from emulation import needs_root

import conveyor.runtime._checkpoint as checkpoint
from conveyor.config import TrainConfig
from conveyor.job import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Two data centres of one worker each, joined by 100 Mbit/s.
GAIA = {
    "model": "mlp",
    "stages": 1,
    "replicas": "2",
    "schedule": "flush",
    "microbatches": 2,
    "network": "1:1.25e9,2:1.25e7",
    "wan": "gaia",
}


@needs_root
def test_a_resumed_run_takes_the_choice_its_checkpoint_keeps(tmp_path: Path) -> None:
    first = train(TrainConfig.from_options(**GAIA, epochs=1, run_dir=str(tmp_path / "a")))
    pilot = first.wan_estimate
    assert pilot is not None and (pilot["sites"], pilot["steps"]) == (2, 40)
    chosen = "on" if pilot["estimate"] else "off"
    assert checkpoint.load(tmp_path / "a" / "checkpoint.pt")["wan_estimate"] == chosen
    assert any(note.startswith(f"--wan-estimate auto: {chosen} ") for note in first.notes())
    resumed = TrainConfig.from_options(
        **GAIA, epochs=1, resume=str(tmp_path / "a" / "checkpoint.pt"), run_dir=str(tmp_path / "b")
    )
    second = train(resumed)
    assert second.wan_estimate is None  # no pilot: the checkpoint's choice
    assert checkpoint.load(Path(second.checkpoint))["wan_estimate"] == chosen
    assert second.epochs_before == 1
