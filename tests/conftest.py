"""Shared test fixtures: where the published PipeDream profiles are, if this checkout has them; the tiers (markers
``slow``, ``root``, ``gpu``: skipped, saying why, where the machine lacks what they need; a test of the fast tier
that starts a process fails, saying to mark it); and which tests pytest-xdist keeps together."""

import multiprocessing.forkserver
import multiprocessing.process
import os
import shutil
import subprocess
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib.font_manager  # noqa: F401  # builds the font cache now (fc-list, a process) rather than in a test
import pytest
from hypothesis import settings

# Property tests check properties, not speed: no per-example deadline (a loaded CI machine missed 200 ms).
settings.register_profile("conveyor", deadline=None)
settings.load_profile("conveyor")

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    """The folder of PipeDream's published graph.txt profiles (``../shared`` beside the checkout)."""
    if not PROFILES.is_dir():
        pytest.skip(f"PipeDream profiles not found at {PROFILES} (only CI and developer machines have ../shared)")
    return PROFILES


def pytest_configure(config: pytest.Config) -> None:
    """One data directory for the session (``CONVEYOR_DATA``, which pytest-xdist's workers inherit), removed at its
    end: the tests' stores and the start-up figures their jobs keep are never the user's, and the figures one
    test's job measured are planned from by the next test's run of the same job, as by a user's second run."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ["CONVEYOR_DATA"] = tempfile.mkdtemp(prefix="conveyor-tests-")
        config.add_cleanup(partial(shutil.rmtree, os.environ["CONVEYOR_DATA"], ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need CUDA and tests marked ``root`` an emulated cluster (root, namespaces, cgroups):
    where the machine lacks either, they are skipped, saying why."""
    import torch
    from emulation import REASON

    reasons = {
        "gpu": None if torch.cuda.is_available() else "needs a CUDA GPU (torch.cuda.is_available() is False here)",
        "root": None if REASON is None else f"cannot emulate a cluster here: {REASON}",
    }
    for item in items:
        for marker, reason in reasons.items():
            if reason is not None and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
        # Under pytest-xdist a group runs in one process, one test at a time: the `serial` tests (whose rates and
        # latencies another test's load would move), and the emulated cluster's (which see each other's cgroups
        # and namespaces, and the cleanup test checks none is left); a root test in network namespaces of its own
        # (`own_network`: anonymous, no cgroup) runs beside the others.
        if item.get_closest_marker("serial"):
            item.add_marker(pytest.mark.xdist_group("serial"))
        elif item.get_closest_marker("root") and not item.get_closest_marker("own_network"):
            item.add_marker(pytest.mark.xdist_group("emulated-cluster"))


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test not marked ``gpu`` runs its workers on the CPU, also on a machine with GPUs (``auto`` would put
    two workers on one GPU under NCCL, which refuses them): ``CONVEYOR_DEVICE=cpu`` for it and its workers."""
    if not request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("CONVEYOR_DEVICE", "cpu")
    else:
        monkeypatch.delenv("CONVEYOR_DEVICE", raising=False)


@pytest.fixture(autouse=True)
def _the_fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier (no ``slow``, ``root`` or ``gpu`` marker) runs in this process: starting a worker process or
    a command there fails the test at once, saying how to file it."""
    if any(request.node.get_closest_marker(marker) for marker in ("slow", "root", "gpu")):
        return

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    # `conveyor train` starts its worker server before it checks its options: here it need not.
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
