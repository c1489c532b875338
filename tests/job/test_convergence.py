"""Convergence smoke test: asynchronous pipelines reach data parallelism's accuracy on real data."""

from pathlib import Path

import pytest

from conveyor.config import TrainConfig
from conveyor.job import train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TARGET = 0.93
MAX_EPOCHS = 12
# What stale weights may cost over data parallelism, with the stale-gradient correction (the default).
# Before it, with these settings: DP and PipeDream 5 epochs, 2BW 9. `conveyor bench convergence` measures
# the cost per model and schedule over seeds (README, "Time to accuracy"); this only bounds it.
EXTRA_EPOCHS = 5


def _epochs_to_target(run_dir: Path, **options: object) -> tuple[int, float]:
    cfg = TrainConfig.from_options(
        epochs=MAX_EPOCHS,
        target_accuracy=TARGET,
        batch_size=64,
        microbatches=4,
        lr=0.05,
        run_dir=str(run_dir),
        **options,
    )
    result = train(cfg)
    return result.epochs, result.accuracy[-1]


def test_pipedream_and_2bw_reach_the_accuracy_of_data_parallelism(tmp_path: Path) -> None:
    dp_epochs, dp_accuracy = _epochs_to_target(tmp_path / "dp", stages=1, replicas="2", schedule="flush")
    assert dp_accuracy >= TARGET
    for schedule in ("pipedream", "2bw"):
        epochs, accuracy = _epochs_to_target(tmp_path / schedule, stages=2, schedule=schedule)
        assert accuracy >= TARGET, schedule
        assert epochs <= dp_epochs + EXTRA_EPOCHS, (schedule, epochs, dp_epochs)
