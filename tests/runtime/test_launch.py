"""The local launcher: results back, the first error reported once, no process left behind."""

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conveyor.processes import job_folder
from conveyor.runtime._launch import WorkerError, keep_first, launch, under_torchrun

pytestmark = pytest.mark.timeout(90)


def _rank_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return int(os.environ["RANK"]), t.item()


def _one_fails_while_others_wait() -> None:
    if dist.get_rank() == 2:
        raise ValueError("bad batch on rank 2")
    dist.recv(torch.zeros(1), src=2)  # would wait forever for the failed rank


def _pids_then_fail(folder: str) -> None:
    with open(os.path.join(folder, f"{dist.get_rank()}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    if dist.get_rank() == 0:
        time.sleep(0.5)
        raise RuntimeError("stop")
    time.sleep(60)


def _sleep_long() -> None:
    time.sleep(60)


@pytest.mark.slow
def test_results_come_back_per_rank() -> None:
    assert launch(_rank_sum, nprocs=3, timeout_s=60) == {0: (0, 3.0), 1: (1, 3.0), 2: (2, 3.0)}


def _narrowed_then_summed() -> tuple[str, int, float] | None:
    """A job of three narrowed to two: the third leaves; the two sum their ranks in the new group, twice (a
    subgroup made after narrowing works too)."""
    if not keep_first(2):
        return None if not dist.is_initialized() else ("still joined", -1, -1.0)
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.all_reduce(t, group=dist.new_group([0, 1]))
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)  # the cores shared by two now
    return os.environ["WORLD_SIZE"], dist.get_world_size(), t.item()


@pytest.mark.slow
def test_a_job_narrowed_to_its_first_workers_goes_on_without_the_others() -> None:
    assert launch(_narrowed_then_summed, nprocs=3) == {0: ("2", 2, 6.0), 1: ("2", 2, 6.0), 2: None}


@pytest.mark.slow
def test_first_error_is_reported_and_everyone_stops() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_one_fails_while_others_wait, nprocs=3, timeout_s=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 2
    assert info.value.error_type == "ValueError"
    assert "bad batch on rank 2" in str(info.value)
    assert "Traceback" in info.value.remote_traceback
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_no_worker_outlives_a_failed_job(tmp_path) -> None:
    with pytest.raises(WorkerError, match="RuntimeError: stop"):
        launch(_pids_then_fail, str(tmp_path), nprocs=3, timeout_s=60)
    for f in tmp_path.glob("*.pid"):
        pid = int(f.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_job_past_its_time_limit_is_killed() -> None:
    with pytest.raises(TimeoutError, match="ran past its 3 s limit"):
        launch(_sleep_long, nprocs=2, timeout_s=3)
    assert not multiprocessing.active_children()


def test_nprocs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        launch(_rank_sum, nprocs=0)


def test_torchrun_is_detected_from_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not under_torchrun()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert under_torchrun()


def _say(text: str) -> str:
    # One write per line: print() writes the text and its newline apart, which the two workers interleave.
    sys.stdout.write(f"out {text} {dist.get_rank()}\n")
    sys.stdout.flush()
    sys.stderr.write(f"err {text} {dist.get_rank()}\n")
    sys.stderr.flush()
    return os.environ["CONVEYOR_TEST_VALUE"]


_MOVED_OUTPUT = """
import os, sys
from conveyor.processes import start_worker_server
from conveyor.runtime import launch
from test_launch import _say

start_worker_server()  # with this process's output and environment of now
os.environ["CONVEYOR_TEST_VALUE"] = "second"
with open(sys.argv[1], "a") as moved:  # appended: three processes write it
    os.dup2(moved.fileno(), 1)  # then the output moves, as a test run's capture does from one test to the next
    os.dup2(moved.fileno(), 2)
    print(launch(_say, "now", nprocs=2), flush=True)
"""


@pytest.mark.slow
def test_workers_get_the_launchers_output_and_environment_of_the_moment(tmp_path: Path) -> None:
    """Workers fork from a server started earlier, with that moment's output and environment; each launch hands
    them its own."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "CONVEYOR_TEST_VALUE": "first"}
    moved = tmp_path / "moved.txt"
    done = subprocess.run([sys.executable, "-c", _MOVED_OUTPUT, str(moved)], env=env, timeout=60, check=False)
    assert done.returncode == 0
    lines = moved.read_text().splitlines()
    assert {"out now 0", "out now 1", "err now 0", "err now 1", "{0: 'second', 1: 'second'}"} <= set(lines)


def test_a_workers_report_says_whether_its_error_was_bad_input() -> None:
    from conveyor.errors import InputError
    from conveyor.runtime._launch import failure_report

    for exc, bad_input in (
        (InputError("--x must be 1"), True),
        (OSError("disk full"), True),
        (ValueError("bug"), False),
    ):
        try:
            raise exc
        except Exception as caught:
            assert failure_report(caught).bad_input is bad_input


def _pid_then_sleep(folder: str) -> None:
    with open(os.path.join(folder, f"{dist.get_rank()}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(60)


_KILLED_LAUNCHER = """
import sys
from conveyor.runtime import launch
from test_launch import _pid_then_sleep

launch(_pid_then_sleep, sys.argv[1], nprocs=2)
"""


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """A worker's parent is the worker server, not its launcher: the server must end, and its workers with it,
    when the launcher is killed outright; the folder it could not remove goes with the next job's start."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    launcher = subprocess.Popen([sys.executable, "-c", _KILLED_LAUNCHER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        folders = list(Path(tempfile.gettempdir()).glob(f"conveyor-launch-*.{launcher.pid}-*"))
        assert len(folders) == 1, "the running launcher's folder"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"workers {pids} outlived their killed launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()
    # A launcher killed outright cannot remove its folder: the next job's start does (another test's, running
    # beside this one, may have already).
    with job_folder("launch"):
        assert not any(folder.exists() for folder in folders)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


def test_a_job_removes_the_folders_of_launchers_that_are_gone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ns = os.stat("/proc/self/ns/pid").st_ino
    gone = tmp_path / f"conveyor-launch-{ns}.4194305-abc"  # above Linux's largest PID (2**22): no such process
    alive = tmp_path / f"conveyor-launch-{ns}.{os.getppid()}-def"  # this test's parent: running
    elsewhere = tmp_path / f"conveyor-launch-{ns + 1}.4194305-ghi"  # another PID namespace's (a container's)
    other = tmp_path / f"conveyor-emulate-{ns}.4194305-jkl"  # another kind's: left to that kind's jobs
    for folder in (gone, alive, elsewhere, other):
        folder.mkdir()
        (folder / "rendezvous").write_text("")
    with job_folder("launch") as mine:
        assert mine.name.startswith(f"conveyor-launch-{ns}.{os.getpid()}-") and mine.is_dir()
        assert not gone.exists() and alive.exists() and elsewhere.exists() and other.exists()
    assert not mine.exists()
