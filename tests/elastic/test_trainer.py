"""Elastic training through revocations and additions: the weights always equal a single-process run of the
committed steps, nothing committed is lost, and losing the reliable tier is a clear error."""

import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.elastic import ElasticJob, ElasticOptions, ElasticTrainer, WorkerOutcome, launch_elastic, planned_layouts
from conveyor.elastic._launch import _ElasticJob, _worker
from conveyor.elastic._membership import connect, latest
from conveyor.plan import Profile
from conveyor.processes import LauncherOutput, worker_context
from conveyor.runtime import WorkerError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BATCH, EPOCHS = 24, 2
JOINER = 3  # the id a worker joining a job of 3 gets
OPTIMIZER = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
# A profile on which the planner's layouts for 4, 3, 2 workers are 3 stages with 2 replicas of the last, 3
# stages, 2 stages (heavy weights, light activations: replicas cost more than stages).
PROFILE = Profile.chain(
    "mlp",
    forward_s=[1e-3, 1e-4, 1e-3, 1e-4, 1e-3],
    backward_s=[2e-3, 2e-4, 2e-3, 2e-4, 2e-3],
    output_bytes=[1000] * 5,
    param_bytes=[40_000_000, 0, 40_000_000, 0, 400_000],
    batch_size=BATCH,
)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(240, 8, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] + x[:, 1] > 0).long()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def reference(steps: int) -> torch.Tensor:
    """The module docstring's update, in one process: step t trains on batch t of the seeded epoch order."""
    x, y = data()
    net, per_epoch = model(), -(-len(x) // BATCH)
    optimizer = OPTIMIZER(net.parameters())
    for t in range(steps):
        epoch, i = divmod(t, per_epoch)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        idx = order[i * BATCH : (i + 1) * BATCH]
        optimizer.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        optimizer.step()
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach()


class Victim(ElasticTrainer):
    """Kills itself mid-state-transfer (as an owner handing its shard over) in a generation after the first."""

    def fit(self, job: ElasticJob, on_step: Any = None) -> WorkerOutcome:
        read = self.held.shard_at

        def read_and_die(c: int) -> torch.Tensor:
            if self.watch.gen is not None and self.watch.gen.gen >= 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return read(c)

        self.held.shard_at = read_and_die  # type: ignore[method-assign]
        return super().fit(job, on_step)


class DiesMidStep(ElasticTrainer):
    """Dies in step 7 after the all-reduce, before the owner's broadcast reaches it: the owner has updated its
    shard for a step that will not complete, and must hand over the one before."""

    def _step(self, t: int) -> None:
        if t == 7:
            self.context.flat.set_buffers = lambda flat: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
        super()._step(t)


def work(
    worker: int | None,
    host: str,
    port: int,
    folder: str,
    opts: ElasticOptions,
    workers: int,
    kills: dict[int, tuple[int, int]],
    victim: int | None,
    pipeline: bool,
    step_s: float,
    join_by: int | None,
) -> WorkerOutcome:
    x, y = data()
    cls = ElasticTrainer
    if victim is not None and worker == abs(victim):
        cls = Victim if victim >= 0 else DiesMidStep
    layout = planned_layouts(PROFILE, 1e9, 4) if pipeline else None
    trainer = cls(
        model(),
        loss_fn=F.cross_entropy,
        make_optimizer=OPTIMIZER,
        worker=worker,
        host=host,
        port=port,
        options=opts,
        workers=workers,
        log_dir=Path(folder),
        layout=layout,
    )

    def on_step(t: int) -> None:
        time.sleep(step_s)  # steps long enough for faults to land mid-run
        if worker in kills and t == kills[worker][0]:
            os.kill(os.getpid(), kills[worker][1])
        if join_by is not None and t >= join_by and worker is not None:  # (not the joiner: its id is None here)
            wait_for_the_joiner(trainer)

    return trainer.fit(ElasticJob(x, y, x, y, BATCH, EPOCHS), on_step)


def wait_for_the_joiner(trainer: ElasticTrainer) -> None:
    """Hold the job (however long the joiner takes to start) until the joiner is a member, stepping on only to
    make a change of membership that is pending (a wait here would hold its boundary, and the joiner waits for it)."""
    assert trainer.watch.gen is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        newest = latest(trainer.store)
        if JOINER in newest.members or newest.gen > trainer.watch.gen.gen:
            return
        time.sleep(0.05)


def after_the_first_change(worker: int | None, host: str, port: int, *args: Any) -> WorkerOutcome:
    """A joiner that starts once worker 0 has recovered into the job's first change of membership (the notice's):
    the notice and the join are then two generations, whenever each process gets the CPU."""
    store = connect(host, port, is_leader=False)
    deadline = time.monotonic() + 60
    while not (store.check(["state_gen"]) and int(store.get("state_gen")) >= 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    return work(worker, host, port, *args)


def run(
    tmp_path: Path,
    workers: int,
    opts: ElasticOptions,
    kills: dict[int, tuple[int, int]],
    victim: int | None = None,
    joiner: bool = False,
    pipeline: bool = False,
) -> list[WorkerOutcome]:
    step_s = 0.05 if pipeline else 0.02
    join_by = EPOCHS * -(-240 // BATCH) // 2 + 2 if joiner else None  # in the second epoch
    args = (str(tmp_path), opts, workers, kills, victim, pipeline, step_s, join_by)
    late = None
    if joiner:  # a worker started by hand (as conveyor train --join would), from outside the launcher
        job = _ElasticJob(
            host="127.0.0.1",
            folder=tmp_path,
            fn=after_the_first_change,
            args=args,
            setup=None,
            threads=1,
            environment=dict(os.environ),
            output=LauncherOutput(),
        )
        late = worker_context().Process(target=_worker, args=(9, None, job))
        late.start()
    try:
        results = launch_elastic(work, *args, nprocs=workers, folder=tmp_path, timeout_s=100)
    finally:
        if late is not None:
            late.join(30)
            assert late.exitcode == 0
    return list(results.values())


def generations(tmp_path: Path) -> list[dict[str, Any]]:
    import json

    lines = [json.loads(line) for line in (tmp_path / "elastic.jsonl").read_text().splitlines()]
    return [e for e in lines if e["event"] == "generation"]


def check_weights(results: list[WorkerOutcome]) -> None:
    steps = EPOCHS * -(-240 // BATCH)
    want = reference(steps)
    finished = [r for r in results if r.weights is not None]
    assert finished
    for r in finished:
        assert r.steps == steps
        torch.testing.assert_close(r.weights, want, atol=1e-5, rtol=0)


def test_stage_1_loses_a_worker_mid_step_and_the_owner_hands_over_the_step_before(tmp_path: Path) -> None:
    # Worker 2 dies in step 7 after the all-reduce: the others are mid-broadcast, and the owner (worker 0) has
    # already updated its shard for a step that will not complete.
    results = run(tmp_path, 3, ElasticOptions(lost_s=1.0), {}, victim=-2)
    check_weights(results)  # step 7 applied once, not twice
    gens = generations(tmp_path)
    assert [g["stage"] for g in gens] == [1, 1] and gens[1]["reason"] == "lost [2]"
    assert gens[1]["from"] == "owners" and gens[1]["resume_step"] == 6 and gens[1]["steps_redone"] <= 1  # in flight


def test_stage_2_owner_lost_without_notice_resumes_from_the_backup(tmp_path: Path) -> None:
    opts = ElasticOptions(lost_s=1.0, sync_max=0.5, backup_every=3)
    results = run(tmp_path, 3, opts, {1: (10, signal.SIGKILL)})
    check_weights(results)
    lost = generations(tmp_path)[1]
    assert generations(tmp_path)[0]["stage"] == 2 and lost["from"] == "backup"
    assert 10 - 2 * 3 <= lost["resume_step"] <= 10 and lost["steps_redone"] <= 2 * 3  # the stated bound


def test_notice_hands_the_shard_over_and_a_joiner_takes_one(tmp_path: Path) -> None:
    opts = ElasticOptions(lost_s=1.0, sync_max=0.5, backup_every=3)
    results = run(tmp_path, 3, opts, {2: (6, signal.SIGTERM)}, joiner=True)
    check_weights(results)
    gens = generations(tmp_path)
    reasons = [g["reason"] for g in gens]
    assert any("notice [2]" in r for r in reasons) and any("joined" in r for r in reasons)
    for g in gens[1:]:
        assert g["planned"] and g["from"] == "owners" and g["steps_redone"] == 0  # nothing lost, nothing redone
    assert any(r.left_at is not None and r.worker == 2 for r in results)


def test_stage_3_owner_killed_mid_state_transfer(tmp_path: Path) -> None:
    # 4 workers, 1 reliable: ratio 3 puts the job in stage 3 (the reliable worker only keeps backups). Worker
    # 3 gets a notice at step 9; worker 2, an owner too, dies while handing its shard over for it.
    opts = ElasticOptions(lost_s=1.0, sync_max=0.5, backup_only_min=2.5, backup_every=2)
    results = run(tmp_path, 4, opts, {3: (9, signal.SIGTERM)}, victim=2)
    check_weights(results)
    gens = generations(tmp_path)
    assert gens[0]["stage"] == 3 and gens[0]["compute"] == [1, 2, 3]
    assert gens[-1]["members"] == [0, 1] and gens[-1]["from"] == "backup"


def test_losing_the_reliable_worker_is_a_clear_error(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(WorkerError, match="reliable"):
        run(tmp_path, 3, ElasticOptions(lost_s=1.0), {0: (5, signal.SIGKILL)})
    assert time.monotonic() - began < 60


def test_pipeline_is_replanned_shorter_from_a_surviving_replica_and_a_notice(tmp_path: Path) -> None:
    # Stage 1 of AgileML (every worker computes). Worker 3, a replica of the last stage, dies without notice:
    # worker 2 hands that stage over (nothing from a backup); then worker 2 leaves with notice and the pipeline
    # becomes two stages.
    opts = ElasticOptions(lost_s=1.0, sync_max=10, backup_only_min=10, backup_every=3)
    results = run(tmp_path, 4, opts, {3: (5, signal.SIGKILL), 2: (12, signal.SIGTERM)}, pipeline=True)
    check_weights(results)
    gens = generations(tmp_path)
    assert [g["layout"] for g in gens] == [
        {"balance": [1, 2, 2], "replicas": [1, 1, 2]},
        {"balance": [1, 2, 2], "replicas": [1, 1, 1]},
        {"balance": [2, 3], "replicas": [1, 1]},
    ]
    assert gens[1]["reason"] == "lost [3]" and gens[1]["from"] == "owners" and gens[1]["steps_redone"] <= 1
    assert gens[2]["planned"] and gens[2]["from"] == "owners" and gens[2]["steps_redone"] == 0


def test_pipeline_stage_lost_with_its_only_worker_resumes_from_the_backup(tmp_path: Path) -> None:
    opts = ElasticOptions(lost_s=1.0, sync_max=10, backup_only_min=10, backup_every=3)
    results = run(tmp_path, 3, opts, {2: (10, signal.SIGKILL)}, pipeline=True)
    check_weights(results)
    gens = generations(tmp_path)
    assert [g["layout"]["replicas"] for g in gens] == [[1, 1, 1], [1, 1]]
    assert gens[1]["from"] == "backup" and 10 - 2 * 3 <= gens[1]["resume_step"] <= 10
