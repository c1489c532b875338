"""The training job behind ``conveyor train``: model zoo, bundled data, layout choice, run folder and plots."""

from conveyor.job._train import TrainConfig, train

__all__ = ["TrainConfig", "train"]
