"""Live reduction: a replica frozen for several whole steps holds up nobody, and every worker, the frozen one
included, ends with the weights, optimizer state and BatchNorm statistics of one process running each batch's
chunks in order; a replica that dies still fails the job in one line."""

import os
import signal
import threading
import time
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from chunked import cuts_of
from torch import nn

from conveyor.runtime import WorkerError, launch, load_checkpoint, split_batch
from conveyor.stragglers import FlexiblePipeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SGD = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SIZES = (24, 24, 24, 17, 24, 24, 24, 24, 24, 24)  # one short batch, its chunks uneven
CHUNKS = 6  # of every batch: 3 replicas x 2, or 2 x 3 (their sizes follow the replicas' measured speeds)
FREEZE_AT, THAW_AFTER = 2, 6  # the replica stops itself in step 2; worker 0 wakes it once past step 6
LAYOUTS = {"dp": (None, [3]), "2-1": ([3, 3], [2, 1])}


def _model() -> nn.Sequential:
    """Six blocks, BatchNorm in the first three (a 2-1 pipeline's replicated stage) and in the last three."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)
    ).double()  # float64: a chunk of two samples makes BatchNorm ill-conditioned in float32


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(n, 8, generator=g, dtype=torch.float64) * 3 + 1, torch.randint(0, 4, (n,), generator=g))
        for n in SIZES
    ]


def _state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Weights, buffers and each weight's momentum, by name."""
    out = {k: v.detach().clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}
    if optimizer is not None:
        for name, p in module.named_parameters():
            out[f"{name}.momentum"] = optimizer.state[p]["momentum_buffer"].clone()
    return out


def _reference(cuts: list[list[int]]) -> dict[str, torch.Tensor]:
    """One process: each batch's mean gradient over its chunks run in order, cut as the run cut them (BatchNorm's
    batch statistics per chunk), then the second run of the first three batches."""
    model = _model()
    opt = SGD(model.parameters())
    for (x, y), cut in zip(_data() + _data()[:3], cuts, strict=True):
        opt.zero_grad()
        for xc, yc in zip(split_batch(x, cut), split_batch(y, cut), strict=True):
            if len(xc):
                (F.cross_entropy(model(xc), yc, reduction="sum") / len(x)).backward()
        opt.step()
    return _state(model, opt)


def _freeze_in_forward(model: nn.Sequential, step: int) -> dict[str, Any]:
    """This process stops itself (SIGSTOP: every thread, gloo's too) in its first forward of ``step`` or later; or,
    where peers' backups took every chunk of ``step`` before it began one, at the end of ``step`` (the trainer's
    on_step calls :func:`_count_step`). Returns what records how it stopped: ``"forward"`` or ``"between steps"``."""
    calls: dict[str, Any] = {"steps": 0, "stopped": None, "at": step}

    def hook(*_: Any) -> None:
        if calls["steps"] >= step and calls["stopped"] is None:
            calls["stopped"] = "forward"
            os.kill(os.getpid(), signal.SIGSTOP)

    model[0].register_forward_pre_hook(hook)
    return calls


def _count_step(calls: dict[str, Any], finished: int) -> None:
    """After this replica's step ``finished - 1``: past the freezing step without a forward, stop now."""
    calls["steps"] = finished
    if finished > calls["at"] and calls["stopped"] is None:
        calls["stopped"] = "between steps"
        os.kill(os.getpid(), signal.SIGSTOP)


def _train(layout: str, live: bool, path: str, fallback_s: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _model()
    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    freezing = _freeze_in_forward(model, FREEZE_AT) if dist.get_rank() == 1 else None
    balance, replicas = LAYOUTS[layout]
    pipe = FlexiblePipeline(
        model,
        loss_fn=F.cross_entropy,
        optimizer=SGD,
        balance=balance,
        replicas=replicas,
        chunks=CHUNKS // replicas[0],
        backup=True,
        live=live,
    )
    woken: dict[str, Any] = {"by": "", "frozen_at_step": None, "woken_at_step": None}
    done = {"step": -1}  # worker 0's last finished step
    wake_now = threading.Event()

    def watch() -> None:
        """Worker 0 waits to see replica 1 stopped (its /proc state "T"), notes its own progress then, and wakes
        it when the step after THAW_AFTER is done, or ``fallback_s`` later if worker 0 cannot get there."""
        deadline = time.monotonic() + 60
        while _state_of(pids[1]) != "T" and time.monotonic() < deadline:
            time.sleep(0.005)
        woken["frozen_at_step"] = done["step"] if _state_of(pids[1]) == "T" else None
        woken["by"] = "step" if wake_now.wait(fallback_s) else "timer"
        woken["woken_at_step"] = done["step"]
        os.kill(pids[1], signal.SIGCONT)

    watcher = threading.Thread(target=watch, daemon=True)
    if dist.get_rank() == 0:
        watcher.start()

    def on_step(step: int) -> None:
        if freezing is not None:
            _count_step(freezing, step)
        done["step"] = step
        if dist.get_rank() == 0 and step == THAW_AFTER + 1:
            wake_now.set()

    feed = _data() if pipe.is_first or pipe.is_last else None
    pipe.train(feed, on_step)
    pipe.train(feed[:3] if feed else None)
    if dist.get_rank() == 0:
        watcher.join()
    records = pipe.gather_records()
    pipe.save(path)
    stopped = None if freezing is None else freezing["stopped"]
    return {"state": _state(pipe.module, pipe.optimizer), "records": records, "woken": woken, "stopped": stopped}


def _state_of(pid: int) -> str:
    """A process's state letter in /proc (R running, S sleeping, T stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.serial  # where in its step the replica stops decides whether a run is dropped: other tests' load
@pytest.mark.parametrize("layout", ["dp", "2-1"])
def test_a_replica_frozen_for_whole_steps_holds_up_nobody_and_rejoins_with_the_reference_state(
    layout: str, tmp_path
) -> None:
    path = str(tmp_path / "model.pt")
    per_rank = launch(_train, layout, True, path, 20.0, nprocs=sum(LAYOUTS[layout][1]), timeout_s=150)
    woken = per_rank[0]["woken"]
    assert woken["frozen_at_step"] is not None, "replica 1 never stopped"
    assert woken["by"] == "step", woken  # worker 0 finished steps 2 to 6 while replica 1 was stopped
    records = next(out["records"] for out in per_rank.values() if out["records"] is not None)
    expected = _reference(cuts_of(records))
    saved = load_checkpoint(path)["model"]
    for name, value in saved.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=f"checkpoint {name}")
    for rank, out in per_rank.items():  # every worker's stage, the frozen replica's included
        assert out["state"], f"worker {rank} holds nothing"
        for name, value in out["state"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=f"worker {rank} {name}")
    frozen = [r for r in records if r["stage"] == 0 and r["replica"] == 1]
    stopped = frozen[FREEZE_AT : THAW_AFTER + 1]
    assert sum(r["samples"] for r in stopped) == 0  # it ran nothing the steps used
    # Stopped in a forward, the run it froze in was replaced by a peer's (in step FREEZE_AT, or a later one where
    # peers' backups had taken every chunk of that step before it began one); stopped between steps, where they
    # had taken every chunk of step FREEZE_AT, no run of its was under way to drop.
    how = per_rank[1]["stopped"]
    assert how in ("forward", "between steps")
    assert [r["dropped"] > 0 for r in stopped].count(True) == (1 if how == "forward" else 0), (how, stopped)
    for step in range(len(SIZES) + 3):  # every sample counted once on each stage
        for stage in range(len(LAYOUTS[layout][1])):
            ran = sum(r["samples"] for r in records if r["step"] == step and r["stage"] == stage)
            assert ran == (SIZES + SIZES[:3])[step]


def test_with_an_all_reduce_the_others_wait_for_the_frozen_replica(tmp_path) -> None:
    # The same freeze with backups alone: the all-reduce needs replica 1, so worker 0 finishes at most the step
    # it was in while replica 1 stays stopped (3 s here, however fast the machine). What live reduction removes.
    per_rank = launch(_train, "dp", False, str(tmp_path / "model.pt"), 3.0, nprocs=3, timeout_s=150)
    woken = per_rank[0]["woken"]
    assert woken["frozen_at_step"] is not None, "replica 1 never stopped"
    assert woken["by"] == "timer", woken
    assert woken["woken_at_step"] - woken["frozen_at_step"] <= 1, woken


def _killed_in_a_chunk() -> None:
    """Worker 1 exits (code 3, no Python error) in its first forward of step 1 or later; where peers' backups
    took every chunk of its step 1 before it began one (a busy machine: CI's 191351e run never reached the
    forward it waited for), at that step's end instead."""
    torch.set_num_threads(1)
    model = _model()
    finished = {"steps": 0}

    def on_step(steps: int) -> None:
        finished["steps"] = steps
        if dist.get_rank() == 1 and steps > 1:
            os._exit(3)

    if dist.get_rank() == 1:
        model[0].register_forward_pre_hook(lambda *_: os._exit(3) if finished["steps"] >= 1 else None)
    pipe = FlexiblePipeline(model, loss_fn=F.cross_entropy, optimizer=SGD, chunks=2, live=True)
    pipe.train(_data(), on_step)
    pipe.gather_records()  # the epoch's end needs every worker


def test_a_replica_killed_mid_step_fails_the_job_in_one_line() -> None:
    with pytest.raises(WorkerError) as failure:
        launch(_killed_in_a_chunk, nprocs=3, timeout_s=60, collective_timeout_s=30)
    assert failure.value.rank == 1
    assert str(failure.value).splitlines()[0] == (
        "worker 1 failed with WorkerDied: exited with code 3 without a Python error (killed, or out of memory?)"
    )
