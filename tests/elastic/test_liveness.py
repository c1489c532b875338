"""A worker's connection to worker 0 closes when its process dies, and stays open while it only stalls."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from conveyor.elastic._liveness import Liveness
from conveyor.elastic._membership import liveness_prefix
from conveyor.elastic.parts import connect

pytestmark = pytest.mark.timeout(60)

WORKER = """
import sys, time
from conveyor.elastic._liveness import keep_alive
keep_alive("127.0.0.1", int(sys.argv[1]), 5)
time.sleep(50)
"""


def until(condition: Callable[[], bool], limit_s: float) -> float:
    """Seconds until ``condition()`` held (``AssertionError`` past ``limit_s``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit_s, f"not within {limit_s} s"
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.mark.slow
def test_a_stalled_worker_stays_connected_and_a_killed_one_is_seen_at_once() -> None:
    server = connect("127.0.0.1", 0, is_leader=True)
    before = server.num_keys()
    liveness = Liveness("127.0.0.1", server.port)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(server.port)])
    try:
        liveness.watch(5)
        until(lambda: liveness.paired(5), 30.0)
        # The rendezvous keys stay (the coordinator deletes them with the worker's others once it is gone).
        assert all(server.check([f"{liveness_prefix(5)}/0/{rank}"]) for rank in range(2))
        assert server.num_keys() == before + 2
        os.kill(worker.pid, signal.SIGSTOP)  # stalled (a busy machine, a pause): still connected
        time.sleep(2.0)
        assert liveness.paired(5) and liveness.closed(5) is None
        os.kill(worker.pid, signal.SIGCONT)
        time.sleep(0.2)
        worker.kill()
        seen = until(lambda: liveness.closed(5) is not None, 5.0)
        why = str(liveness.closed(5))
        assert seen < 1.0 and why.startswith(("Connection closed by peer", "Read error")), why  # (or reset)
        liveness.forget(5)
        assert not liveness.paired(5) and liveness.closed(5) is None
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_that_never_connects_is_not_paired() -> None:
    """Its death is then left to its heartbeat: the coordinator gives an unconnected worker the short limit."""
    server = connect("127.0.0.1", 0, is_leader=True)
    liveness = Liveness("127.0.0.1", server.port)
    liveness.watch(7)
    time.sleep(1.0)
    assert not liveness.paired(7) and liveness.closed(7) is None
    liveness.forget(7)
