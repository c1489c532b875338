"""Launch backends: local process groups and Ray tasks start, report, queue for devices and stop commands."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conveyor.cluster._backends import Backend, Launched, LocalBackend, RayBackend

pytestmark = pytest.mark.timeout(60)

# A command that starts a child (its grandchild, from the backend's side) and sleeps; both carry argv[1].
SLEEPER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1]]); time.sleep(120)"
)
# Writes its start time to argv[1].start, waits until the file argv[2] exists (if given), sleeps argv[3]
# seconds, writes its end time to argv[1].end.
TIMED = (
    "import pathlib, sys, time; p = sys.argv[1]; pathlib.Path(p + '.start').write_text(repr(time.time())); "
    "deadline = time.time() + 30\n"
    "while sys.argv[2] and not pathlib.Path(sys.argv[2]).exists():\n"
    "    time.sleep(0.02)\n"
    "    time.time() < deadline or sys.exit('never met ' + sys.argv[2])\n"
    "time.sleep(float(sys.argv[3])); pathlib.Path(p + '.end').write_text(repr(time.time()))"
)


def _pids_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (a zombie's is empty)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _until(check: Callable[[], object], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _wait(backend: Backend, launched: Launched, timeout_s: float = 30.0) -> int:
    _until(lambda: backend.poll(launched) is not None, timeout_s)
    code = backend.poll(launched)
    assert code is not None
    return code


def _sleeper(backend: Backend, tmp_path: Path, device_type: str = "slow") -> tuple[Launched, str]:
    """A sleeping command and its child, both running once this returns."""
    marker = f"conveyor-test-{uuid.uuid4().hex}"
    launched = backend.launch(
        "sleeper", [sys.executable, "-c", SLEEPER, marker], device_type=device_type, devices=1, log=tmp_path / "s.log"
    )
    _until(lambda: len(_pids_with(marker)) == 2)
    return launched, marker


@pytest.mark.slow
def test_local_launch_reports_the_exit_code_and_passes_env(tmp_path: Path) -> None:
    code = "import os, time; print(os.environ['GREETING']); time.sleep(0.3); raise SystemExit(3)"
    with LocalBackend() as backend:
        job = backend.launch(
            "three",
            [sys.executable, "-c", code],
            device_type="cpu",
            devices=1,
            log=tmp_path / "logs" / "three.log",
            env={"GREETING": "hello"},
        )
        assert backend.poll(job) is None
        assert _wait(backend, job) == 3 and job.returncode == 3
        assert backend.stop(job) == 3  # stopping what has ended only reports it
    assert (tmp_path / "logs" / "three.log").read_text() == "hello\n"


@pytest.mark.slow
def test_local_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    with LocalBackend() as backend:
        job, marker = _sleeper(backend, tmp_path)
        assert backend.poll(job) is None
        assert backend.stop(job, grace_s=5) == -15  # SIGTERM
        _until(lambda: not _pids_with(marker), 5)
        # One that ignores SIGTERM gets SIGKILL once the grace period is over.
        code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
        stubborn = backend.launch(
            "stubborn", [sys.executable, "-c", code, marker], device_type="cpu", devices=1, log=tmp_path / "x.log"
        )
        _until(lambda: bool(_pids_with(marker)))
        time.sleep(0.3)  # let it install its handler
        began = time.monotonic()
        assert backend.stop(stubborn, grace_s=0.5) == -9 and time.monotonic() - began >= 0.5
        assert not _pids_with(marker)


@pytest.mark.slow
def test_local_close_stops_what_still_runs(tmp_path: Path) -> None:
    backend = LocalBackend(grace_s=2)
    job, marker = _sleeper(backend, tmp_path)
    backend.close()
    assert job.returncode == -15
    _until(lambda: not _pids_with(marker), 5)
    backend.close()  # twice is harmless


@pytest.fixture(scope="module")
def ray_backend() -> Iterator[RayBackend]:
    try:
        import ray
    except ImportError:
        pytest.skip("ray is not installed: pip install 'conveyor[ray]' to test the Ray backend")
    backend = RayBackend(resources={"fast": 1, "slow": 1}, num_cpus=2, grace_s=2)
    yield backend
    backend.close()
    assert not ray.is_initialized()  # it started Ray, so it shut it down


@pytest.mark.slow  # Ray starts its own processes
@pytest.mark.xdist_group("ray")  # one Ray instance for the module (the fixture), on one xdist worker
@pytest.mark.timeout(90)
def test_ray_runs_a_command_where_its_devices_are(ray_backend: RayBackend, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    code = "import os, pathlib, sys; pathlib.Path(sys.argv[1]).write_text('ran'); print(os.environ['GREETING'])"
    argv = [sys.executable, "-c", code, str(marker)]
    job = ray_backend.launch(
        "marker", argv, device_type="fast", devices=1, log=tmp_path / "m.log", env={"GREETING": "hello"}
    )
    assert _wait(ray_backend, job) == 0
    assert marker.read_text() == "ran" and (tmp_path / "m.log").read_text() == "hello\n"
    with pytest.raises(ValueError, match=r"has 0 'tpu' devices, the job needs 1: start its nodes with --resources"):
        ray_backend.launch(
            "nowhere", [sys.executable, "-c", "pass"], device_type="tpu", devices=1, log=tmp_path / "n.log"
        )
    with pytest.raises(ValueError, match="has 1 'fast' devices, the job needs 2"):
        ray_backend.launch(
            "too-big", [sys.executable, "-c", "pass"], device_type="fast", devices=2, log=tmp_path / "n.log"
        )


@pytest.mark.slow  # Ray starts its own processes
@pytest.mark.xdist_group("ray")  # one Ray instance for the module (the fixture), on one xdist worker
@pytest.mark.timeout(90)
def test_ray_jobs_wait_for_devices_of_their_type(ray_backend: RayBackend, tmp_path: Path) -> None:
    """Two jobs on the one fast device run one after the other; a job on the slow one runs beside the first
    (the first and it wait for each other: were they serialised, neither would end)."""
    a, b, c = (str(tmp_path / name) for name in "abc")
    first = ray_backend.launch(
        "a",
        [sys.executable, "-c", TIMED, a, c + ".start", "0.3"],
        device_type="fast",
        devices=1,
        log=tmp_path / "a.log",
    )
    second = ray_backend.launch(
        "b", [sys.executable, "-c", TIMED, b, "", "0"], device_type="fast", devices=1, log=tmp_path / "b.log"
    )
    beside = ray_backend.launch(
        "c", [sys.executable, "-c", TIMED, c, a + ".start", "0"], device_type="slow", devices=1, log=tmp_path / "c.log"
    )
    assert [_wait(ray_backend, job) for job in (first, second, beside)] == [0, 0, 0], (tmp_path / "a.log").read_text()
    assert float(Path(b + ".start").read_text()) >= float(Path(a + ".end").read_text())


@pytest.mark.slow  # Ray starts its own processes
@pytest.mark.xdist_group("ray")  # one Ray instance for the module (the fixture), on one xdist worker
@pytest.mark.timeout(90)
def test_ray_stop_kills_the_command_and_its_children(ray_backend: RayBackend, tmp_path: Path) -> None:
    job, marker = _sleeper(ray_backend, tmp_path, "slow")
    assert ray_backend.poll(job) is None
    # A job queued behind it for the slow device is taken out of the queue: it never starts.
    queued = ray_backend.launch(
        "queued", [sys.executable, "-c", SLEEPER, marker + "q"], device_type="slow", devices=1, log=tmp_path / "q.log"
    )
    assert ray_backend.poll(queued) is None
    assert ray_backend.stop(queued, grace_s=2) == -15
    assert ray_backend.stop(job, grace_s=2) == -15
    _until(lambda: not _pids_with(marker), 10)
    # The device is free again: a stop frees it as an exit does.
    again = ray_backend.launch(
        "again", [sys.executable, "-c", "pass"], device_type="slow", devices=1, log=tmp_path / "again.log"
    )
    assert _wait(ray_backend, again) == 0
