"""Retired process groups are destroyed off the worker's thread: over many generations a process holds a
constant number of threads and descriptors, and a group with work in flight towards a stopped peer does not
hold the worker up."""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conveyor.elastic._comm import destroy_groups
from conveyor.elastic.parts import connect
from conveyor.job._resources import sample_resources

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="counts threads and descriptors in /proc"),
]

TIMEOUT_S = 2.0  # the groups' own limit, which a destructor waits out when work is in flight
EVERY_S = TIMEOUT_S / 5  # one generation per: about 5 retired within a timeout (an elastic run's are seconds apart)


def _held() -> tuple[int, int]:
    """This process's threads and open descriptors."""
    sample = sample_resources(0, None, started=0.0)
    return sample.threads, sample.fds


def _generation(clients: list[dist.TCPStore], g: int) -> list[dist.ProcessGroupGloo]:
    """A gloo group of 2 ranks (each built by a thread, as two workers would), one all-reduce done on it.

    Each rank builds on its one store client, as a worker does: a new client per group would be a new connection,
    which c10d names by a reverse DNS lookup, and a resolver that drops a query holds it for its timeout (5 s,
    about one connection in 25 on the CI's machine), longer than the rendezvous may take."""
    groups: dict[int, dist.ProcessGroupGloo] = {}

    def build(rank: int) -> None:
        prefix = dist.PrefixStore(f"pg/{g}/train/", clients[rank])
        groups[rank] = dist.ProcessGroupGloo(prefix, rank, 2, timedelta(seconds=TIMEOUT_S))

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for work in [groups[rank].allreduce([torch.ones(4)]) for rank in range(2)]:
        work.wait()
    return [groups[0], groups[1]]


def test_twenty_five_generations_hold_what_the_first_held() -> None:
    server = connect("127.0.0.1", 0, is_leader=True)
    clients = [connect("127.0.0.1", server.port, is_leader=False) for _ in range(2)]
    retired: list[dist.ProcessGroupGloo] = []
    held, longest = [], 0.0
    for g in range(25):
        time.sleep(EVERY_S)
        groups = _generation(clients, g)
        if g % 2:  # rank 0 posts an all-reduce its peer never joins: in flight until the group's timeout
            groups[0].allreduce([torch.ones(4)])
        began = time.monotonic()
        destroy_groups(retired)  # the generation before's
        longest = max(longest, time.monotonic() - began)
        retired = groups
        held.append(_held())
    time.sleep(TIMEOUT_S + 1)  # the last destructions waiting out the timeout
    destroy_groups(retired)
    time.sleep(TIMEOUT_S + 1)
    first_threads, first_fds = held[0]
    threads, fds = _held()
    # Kept instead, each generation's two groups add 6 threads and 14 descriptors: 150 and 350 after 25.
    assert threads <= first_threads + 4 and fds <= first_fds + 6, (held, (threads, fds))
    assert max(t for t, _ in held) <= first_threads + 20, held  # bounded meanwhile: one timeout's retirees
    assert longest < TIMEOUT_S / 2  # never the destructor's wait on the worker's thread
