"""Shared test fixtures: where the published PipeDream profiles are, if this checkout has them."""

from pathlib import Path

import pytest

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    """The folder of PipeDream's published graph.txt profiles (``../shared`` beside the checkout)."""
    if not PROFILES.is_dir():
        pytest.skip(f"PipeDream profiles not found at {PROFILES} (only CI and developer machines have ../shared)")
    return PROFILES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA: without it they are skipped, saying so (``pytest -m gpu`` runs only them)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test not marked ``gpu`` runs its workers on the CPU, also on a machine with GPUs (``auto`` would put
    two workers on one GPU under NCCL, which refuses them): ``CONVEYOR_DEVICE=cpu`` for it and its workers."""
    if "gpu" not in request.keywords:
        monkeypatch.setenv("CONVEYOR_DEVICE", "cpu")
    else:
        monkeypatch.delenv("CONVEYOR_DEVICE", raising=False)
