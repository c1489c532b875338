"""A watcher that removes a job's cgroups once its launcher dies, however it died.

Network namespaces need no watcher (they die with their last process); cgroups are directories that
stay. ``python -m conveyor.emulate._janitor OWNER_PID JOB`` waits for OWNER_PID to exit, then kills what
is left in JOB's cgroups (a frozen worker cannot die of its parent-death signal) and removes them.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from conveyor.emulate._cgroups import remove_job

__all__ = ["start_janitor"]


def start_janitor(job: str) -> subprocess.Popen[bytes]:
    """Start the watcher of this process's job ``job``, in a session of its own so it outlives us."""
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor.emulate._janitor", str(os.getpid()), job],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )


def _main(owner: int, job: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the launcher cleaned up itself and lets us go
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        pass  # already gone
    else:
        select.select([pidfd], [], [])  # readable once the owner has exited
    remove_job(job)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2])
