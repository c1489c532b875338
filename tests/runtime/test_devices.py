"""Which device and backend a job gets, how many workers by default, and the one-line errors for what a machine
cannot run (CUDA faked where the test needs it: these run on machines without a GPU)."""

import os

import pytest
import torch

import conveyor.runtime._devices as devices
from conveyor.runtime import check_workers, default_workers, launch, resolve_backend, resolve_device


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that says it has two CUDA GPUs (nothing here touches them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_is_cuda_where_there_is_a_gpu_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_DEVICE")  # (which the suite sets: auto means the CPU where it says so)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == "cpu"
    assert resolve_backend("auto", "cpu") == "gloo"
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert default_workers("cpu") == 2  # one per core this process may use
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(64)))
    assert default_workers("cpu") == 4  # and no more than 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("CPU") == "cpu"
    monkeypatch.setenv("CONVEYOR_DEVICE", "cpu")
    assert resolve_device("auto") == "cpu" and resolve_device("cuda") == "cuda"


def test_cuda_is_one_worker_per_gpu_over_nccl(two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert default_workers("cuda") == 2 and resolve_backend(None, "cuda") == "nccl"
    check_workers(2, "cuda", "nccl")
    check_workers(8, "cuda", "gloo")  # shared-GPU mode: any number
    with pytest.raises(ValueError) as error:
        check_workers(4, "cuda", "nccl")
    assert str(error.value) == (
        "4 workers on this machine but 2 GPU(s): NCCL needs a GPU per worker: use --workers 2, --device cpu, or "
        "--backend gloo (workers share the GPUs: for tests and one-GPU machines)"
    )


def test_what_a_machine_lacks_is_one_line_that_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda: this machine has no CUDA GPU .*: use --device cpu$"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^NCCL joins GPUs, and this job runs on the CPU: use --backend gloo"):
        resolve_backend("nccl", "cpu")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match=r"^this PyTorch build has no NCCL: use --backend gloo"):
        resolve_backend("nccl", "cuda")
    with pytest.raises(ValueError, match=r"^unknown device 'tpu': use one of auto, cpu, cuda$"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match=r"^unknown backend 'mpi': use one of auto, nccl, gloo$"):
        resolve_backend("mpi", "cpu")


def test_a_worker_computes_where_its_launcher_said(two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank 3 of a CUDA job on two GPUs shares the second (shared-GPU mode); a CPU job stays on the CPU
    although the machine has GPUs."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CONVEYOR_DEVICE", "cuda")  # what the launcher sets in its workers
    assert devices.default_device() == torch.device("cuda", 1)
    monkeypatch.setenv("CONVEYOR_DEVICE", "cpu")
    assert devices.default_device() == torch.device("cpu")


def _device_type() -> str:
    return devices.default_device().type


@pytest.mark.slow
def test_the_launcher_hands_its_workers_the_device() -> None:
    assert launch(_device_type, nprocs=2, device="cpu", timeout_s=60) == {0: "cpu", 1: "cpu"}
