"""A worker's holdings, sampled: each series moves with what the process holds, and the log writes one line
per sample and worker."""

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from conveyor.config import check_resources_every
from conveyor.errors import InputError
from conveyor.job._resources import ResourceLog, sample_resources

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the samples read Linux's /proc/self")


def test_each_series_follows_what_the_process_holds(tmp_path: Path) -> None:
    store = dist.HashStore()
    before = sample_resources(3, store, started=time.monotonic())
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    memory = np.ones(64 * 2**20 // 8)  # 64 MiB, written, so resident
    store.set("a", "1")
    with (tmp_path / "f").open("w"):
        after = sample_resources(3, store, started=time.monotonic())
    release.set()
    thread.join()
    assert (before.worker, after.worker) == (3, 3)
    assert after.threads == before.threads + 1
    assert after.fds == before.fds + 1
    assert after.store_keys == before.store_keys + 1 == 1
    assert after.rss_bytes - before.rss_bytes >= 60 * 2**20
    del memory
    assert sample_resources(0, None, started=0.0).store_keys is None


def test_the_log_samples_at_start_at_its_period_and_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "resources.jsonl"
    with ResourceLog(path, worker=1, every_s=0.05, store=dist.HashStore()):
        time.sleep(0.3)
    with ResourceLog(path, worker=2, every_s=None, store=None):  # off: nothing written
        pass
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert 4 <= len(lines) <= 9  # start, about 6 in 0.3 s on a busy host, the end
    assert {line["worker"] for line in lines} == {1}
    assert set(lines[0]) == {"worker", "pid", "t_s", "wall", "rss_bytes", "fds", "threads", "store_keys"}
    times = [line["t_s"] for line in lines]
    assert times == sorted(times) and times[-1] >= 0.3
    assert all(line["threads"] >= 2 for line in lines[:-1])  # the sampler's own thread, while it runs


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_a_period_that_is_not_positive_is_refused(seconds: float) -> None:
    with pytest.raises(InputError, match="--resources-every"):
        check_resources_every(seconds)
    check_resources_every(None)
    check_resources_every(10.0)


def test_a_sample_after_the_stores_host_left_has_no_key_count() -> None:
    """An elastic job's last samples may come after the worker holding the store left: the sample says so."""

    class GoneStore(dist.Store):
        def num_keys(self) -> int:
            raise dist.DistNetworkError("Connection reset by peer")

    sample = sample_resources(0, GoneStore(), started=0.0)
    assert sample.store_keys is None and sample.rss_bytes > 0
