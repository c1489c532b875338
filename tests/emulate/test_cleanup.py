"""Nothing of an emulated cluster survives its job, even a launcher killed with SIGKILL (root only): its folders go
with the next job's start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from emulation import needs_root

from conveyor.emulate._cgroups import cgroup_roots
from conveyor.processes import job_folder

pytestmark = [needs_root, pytest.mark.timeout(120)]

_LAUNCHER = """
import sys
from emulation import pid_then_barriers
from conveyor.emulate import Emulation, launch_emulated
emulation = Emulation(network="2:1.25e9,2:1.25e7", devices="0.5", faults="pause:worker=3,at=1,for=100")
launch_emulated(pid_then_barriers, sys.argv[1], nprocs=4, emulation=emulation, log_dir=sys.argv[1])
"""


def _network_namespaces() -> set[str]:
    """Every network namespace something holds: a process in it, an open descriptor, or a mount."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            found.add(os.readlink(proc / "ns" / "net"))
            found.update(link for fd in (proc / "fd").iterdir() if (link := os.readlink(fd)).startswith("net:["))
        except OSError:  # the process exited meanwhile
            continue
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if "nsfs" in line and "net:[" in line:
            found.add(line.split()[3].strip("/"))
    return found


def _job_cgroups(owner: int) -> list[Path]:
    return [d for root in cgroup_roots() if root.is_dir() for d in root.glob(f"job-{owner}-*")]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _wait_for(condition, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.serial  # it reads the machine's namespaces, links and cgroups, which another job would change
def test_sigkill_of_the_launcher_leaves_no_namespace_link_cgroup_or_folder(tmp_path: Path) -> None:
    before = _network_namespaces()
    roots_before = [root.exists() for root in cgroup_roots()]
    root_links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], env=env)
    try:
        assert _wait_for(lambda: len(list(tmp_path.glob("pid-*"))) == 4, 60), "the workers did not start"
        assert _wait_for(
            lambda: (tmp_path / "faults.jsonl").exists() and "pause" in (tmp_path / "faults.jsonl").read_text(), 10
        )
        workers = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
        during = _network_namespaces() - before
        assert len(during) >= 5, "the job should have a namespace per worker and one for its bridges"
        assert _job_cgroups(launcher.pid), "the job should have cgroups"
        scratch = Path(tempfile.gettempdir())
        folders = [
            *scratch.glob(f"conveyor-emulate-*.{launcher.pid}-*"),
            *scratch.glob(f"conveyor-launch-*.{launcher.pid}-*"),
        ]
        assert len(folders) == 2, "the running job's folders: the emulated cluster's and the launcher's"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    assert _wait_for(lambda: not any(_alive(pid) for pid in workers), 15), "a worker outlived its launcher"
    assert _wait_for(lambda: not _job_cgroups(launcher.pid), 15), "the job's cgroups were left behind"
    assert [root.exists() for root in cgroup_roots()] == roots_before, "conveyor's cgroup folder was left behind"
    assert _wait_for(lambda: not (_network_namespaces() & during), 15), "a namespace of the job was left behind"
    after_links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert after_links == root_links  # the job never touched this machine's own network
    with job_folder("emulate"), job_folder("launch"):  # a killed launcher's folders go at the next job's start
        assert not any(folder.exists() for folder in folders)
