"""The multi-node guide's torchrun commands on two emulated machines: two network namespaces joined by a veth link,
torchrun in each, the rendezvous at the first one's address (root: skipped, saying why, where namespaces are not
available)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.emulate._netns import Namespace, enter_namespace

pytestmark = [pytest.mark.root, pytest.mark.own_network, pytest.mark.timeout(300)]

ADDRESSES = ("10.77.0.1", "10.77.0.2")
INTERFACES = ("cva", "cvb")


@contextlib.contextmanager
def _two_machines() -> Iterator[tuple[Namespace, Namespace]]:
    """Two namespaces, each a machine with one interface, joined by a veth link (deleted with them)."""
    first, second = Namespace(), Namespace()
    try:
        first.batch(
            "ip",
            [
                "link set lo up",
                f"link add {INTERFACES[0]} type veth peer name {INTERFACES[1]} netns {second.path}",
                f"addr add {ADDRESSES[0]}/24 dev {INTERFACES[0]}",
                f"link set {INTERFACES[0]} up",
            ],
        )
        second.batch(
            "ip", ["link set lo up", f"addr add {ADDRESSES[1]}/24 dev {INTERFACES[1]}", f"link set {INTERFACES[1]} up"]
        )
        yield first, second
    finally:
        first.close()
        second.close()


def _start(machine: Namespace, node: int, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python ARGV`` inside machine ``node``'s namespace; gloo is told its interface (in a namespace the host
    name resolves to no address of its own)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": INTERFACES[node], "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: enter_namespace(machine.path),
        )


def _torchrun(machine: Namespace, node: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """The guide's command for machine ``node``, one worker each."""
    command = ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"]
    command += ["--master-addr", ADDRESSES[0], "--master-port", "29517", "-m", "conveyor.cli", "train", *args]
    return _start(machine, node, command, log)


ARGS = ["--model", "mlp", "--stages", "2", "--device", "cpu"]
COMPARED = 2  # epochs each two-machine run is compared over, with the same job's on one machine


def test_torchrun_on_two_machines_trains_as_one_and_a_ctrl_c_to_either_stops_both_at_an_epochs_end(
    tmp_path: Path,
) -> None:
    """The guide's torchrun on two machines trains as the same job on one (the same layout, data and seed: the
    same accuracy epoch by epoch). torchrun forwards a Ctrl-C to its worker, which asks every worker to stop at the
    epoch's end (the stop is agreed in the epoch's all-reduce): the run ends there on both machines, its checkpoint
    (worker 0's, on the first machine) and summary written; the Ctrl-C goes to each machine in turn."""
    # The job on one machine, run by this process (as a subprocess it would first spend ~11 s of CPU on imports).
    assert main(["train", *ARGS, "--epochs", str(COMPARED), "--run-dir", str(tmp_path)]) == 0
    on_one_machine = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for node in (0, 1):
        run = tmp_path / f"ctrl-c-to-{node}"
        _interrupt_on_two_machines(node, run)
        summary = json.loads((run / "summary.json").read_text())
        epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert summary["interrupted"] and COMPARED <= summary["epochs"] < 500, node
        assert [e["epoch"] for e in epochs] == list(range(1, summary["epochs"] + 1))  # every epoch it began, it ended
        for two, alone in zip(epochs, on_one_machine, strict=False):
            assert two["accuracy"] == pytest.approx(alone["accuracy"], abs=0.02), (node, two, alone)
        assert (run / "checkpoint.pt").exists()


def _interrupt_on_two_machines(node: int, run: Path) -> None:
    """The job on two machines until it has trained the compared epochs, then a Ctrl-C to machine ``node``'s
    torchrun; their output in ``run``'s ``node*.log``."""
    run.mkdir()
    metrics = run / "metrics.jsonl"
    with _two_machines() as machines:
        args = [*ARGS, "--epochs", "500", "--run-dir", str(run)]
        runs = [_torchrun(m, n, args, run / f"node{n}.log") for n, m in enumerate(machines)]
        try:
            deadline = time.monotonic() + 120
            while _lines(metrics) < COMPARED and time.monotonic() < deadline and runs[node].poll() is None:
                time.sleep(0.2)  # training: the compared epochs have ended
            runs[node].send_signal(signal.SIGINT)
            runs[node].wait(timeout=120)
            if node == 0:  # the rendezvous' machine: the other's torchrun ends with it
                runs[1].wait(timeout=120)
            # Else the first machine's torchrun waits in its own exit barrier (300 s, not an option) for the
            # agent the Ctrl-C ended: its worker has saved and exited; the test does not wait for the agent.
        finally:
            for process in runs:
                process.kill()
    assert (run / "summary.json").exists(), [(run / f"node{n}.log").read_text()[-3000:] for n in range(2)]


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_machine_joins_an_elastic_job_started_on_another(tmp_path: Path) -> None:
    """The elastic guide's ``conveyor train --join HOST:PORT`` from the second machine, at the first one's address
    and the port its worker 0 wrote to store.txt: the job takes the joiner in. The job runs until then (its lease
    is moved to now once the joiner is in: it stops at that epoch's end, and the joiner with it)."""
    from conveyor.elastic import store_address
    from conveyor.job import write_lease

    run, lease = tmp_path / "run", tmp_path / "lease.json"
    write_lease(lease, time.time() + 3600)
    args = ["-m", "conveyor.cli", "train", "--reliable", "1", "--workers", "2", "--epochs", "100000"]
    with _two_machines() as (first, second):
        job = _start(first, 0, [*args, "--lease", str(lease), "--run-dir", str(run)], tmp_path / "job.log")
        joiner = None
        try:
            _, port = store_address(run, timeout_s=120)
            join = ["-m", "conveyor.cli", "train", "--join", f"{ADDRESSES[0]}:{port}", "--run-dir", str(tmp_path / "j")]
            joiner = _start(second, 1, join, tmp_path / "joiner.log")
            deadline = time.monotonic() + 180
            while not _joined(run / "elastic.jsonl") and time.monotonic() < deadline and job.poll() is None:
                time.sleep(0.5)
            write_lease(lease, time.time())
            codes = [job.wait(timeout=120), joiner.wait(timeout=120)]
        finally:
            for process in (job, joiner):
                if process is not None:
                    process.kill()
    logs = [(tmp_path / name).read_text()[-3000:] for name in ("job.log", "joiner.log")]
    joined = _joined(run / "elastic.jsonl")
    assert codes == [0, 0] and joined, logs
    assert len(joined[0]["members"]) == 3  # the two of the first machine and the joiner


def _joined(log: Path) -> list[dict[str, object]]:
    """The generations of an elastic job's log that took a joiner in."""
    lines = log.read_text().splitlines() if log.exists() else []
    events = [json.loads(line) for line in lines]
    return [e for e in events if e.get("event") == "generation" and "joined" in str(e.get("reason"))]
