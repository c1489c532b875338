"""conveyor train's options checked against the model and data, before any worker starts."""

import pytest
import torch

import conveyor.runtime._checkpoint as checkpoint
from conveyor.job import TrainConfig, check_against_data

MODEL = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_a_batch_may_start_above_the_data_only_when_the_tuner_chooses_it() -> None:
    check_against_data(TrainConfig(batch_size=64), MODEL, samples=64)
    with pytest.raises(ValueError, match="--batch-size 65 is more than the 64 training samples"):
        check_against_data(TrainConfig(batch_size=65), MODEL, samples=64)
    auto = TrainConfig(batch_size=65, tune_batch_size=True, job="nightly", target_accuracy=0.9)  # auto=65
    check_against_data(auto, MODEL, samples=64)


def test_microbatches_and_a_checkpoint_must_fit(tmp_path) -> None:
    with pytest.raises(ValueError, match="--microbatches 9 is more than the 8 samples of a batch"):
        check_against_data(TrainConfig(batch_size=8, microbatches=9), MODEL, samples=64)
    ours = tmp_path / "ours.pt"
    checkpoint.save(ours, MODEL.state_dict())
    check_against_data(TrainConfig(resume=str(ours)), MODEL, samples=64)
    other = tmp_path / "other.pt"
    checkpoint.save(other, torch.nn.Sequential(torch.nn.Linear(4, 5)).state_dict())
    with pytest.raises(ValueError, match="is from another model"):
        check_against_data(TrainConfig(resume=str(other)), MODEL, samples=64)
