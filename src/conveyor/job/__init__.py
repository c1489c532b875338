"""The training job behind ``conveyor train``: model zoo, bundled data, measured costs, layout choice, run folder."""

from conveyor.job._config import check_against_data, loss_and_optimizer
from conveyor.job._data import Dataset, rows
from conveyor.job._data import load as load_dataset
from conveyor.job._elastic import join_elastic, train_elastic
from conveyor.job._layout import Layout, choose_layout
from conveyor.job._lease import lease_expires, read_lease, write_lease
from conveyor.job._loader import EpochBatches
from conveyor.job._model import model_and_data
from conveyor.job._report import plot_accuracy, read_jsonl
from conveyor.job._summary import (
    ElasticSummary,
    RunPrediction,
    RunSummary,
    Summary,
    open_run_folder,
    steady_rate,
    write_run_folder,
)
from conveyor.job._train import train
from conveyor.job._zoo import default_dataset, gpt, mlp, resnet, resolve, user_model, vgg, vgg16

__all__ = [
    "Dataset",
    "ElasticSummary",
    "EpochBatches",
    "Layout",
    "RunPrediction",
    "RunSummary",
    "Summary",
    "check_against_data",
    "choose_layout",
    "default_dataset",
    "gpt",
    "join_elastic",
    "lease_expires",
    "load_dataset",
    "loss_and_optimizer",
    "mlp",
    "model_and_data",
    "open_run_folder",
    "plot_accuracy",
    "read_jsonl",
    "read_lease",
    "resnet",
    "resolve",
    "rows",
    "steady_rate",
    "train",
    "train_elastic",
    "user_model",
    "vgg",
    "vgg16",
    "write_lease",
    "write_run_folder",
]
