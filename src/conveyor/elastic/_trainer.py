"""Elastic data-parallel training on reliable and transient workers that keeps going through revocations.

Every computing worker of generation ``G`` (:mod:`conveyor.elastic._membership`) runs its part of step
``t``'s batch (the same global batch whatever the membership: batch ``t`` of the seeded epoch order, cut
evenly among the computing workers), and one all-reduce sums the gradients, the float buffers and the sample
count. Each shard's owner (:mod:`conveyor.elastic._tiers`) applies the mean gradient to its shard and
broadcasts the shard's new weights:

    g(t) = sum_w n_w grad l_w(W(t)) / sum_w n_w,    W(t + 1)[a:b] = opt_shard(W(t)[a:b], g(t)[a:b])

which, for an elementwise optimizer, is the single-process update ``W(t + 1) = opt(W(t), g(t))``. A step is
*committed* once every owner has completed it; an owner keeps its shard of the step before, so any owner can
give its shard at the committed step ``c = min over owners of their last step``.

On a new generation every participant (members and leavers) meets in a fresh group and reports its last
step; worker 0 (reliable, the store's host) assembles the whole state at ``c`` from the owners (a leaver with
notice is one of them, so nothing is lost) or, when an owner was lost without notice, from its backup at
step ``b`` (stage 2 and 3 lose the ``<= 2 * backup_every`` steps since), broadcasts it to everybody, and the
new owners take their shards. Training resumes at step ``c + 1`` (or ``b + 1``): the steps redone are at most
the one in flight (or those since the backup), and the weights equal a run that saw the committed steps,
because a step's batch does not depend on who runs it.

Given a ``layout``, the computing workers run an elastic pipeline instead (:mod:`conveyor.elastic._pipeline`):
each stage is a shard held by the stage's replicas, and the same recovery moves it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from conveyor.elastic._comm import Watch
from conveyor.elastic._handover import Handover, Left
from conveyor.elastic._held import Groups, HeldState, Placement, WorkerContext
from conveyor.elastic._job import ElasticJob, ElasticOptions, WorkerOutcome
from conveyor.elastic._liveness import Liveness, keep_alive
from conveyor.elastic._membership import (
    NOTICE,
    Generation,
    Heartbeat,
    JobFailed,
    MembershipChanged,
    connect,
    listen_for_notice,
)
from conveyor.elastic._pipeline import StagedStep, StageLayout
from conveyor.elastic._state import FlatModel, state_layout
from conveyor.elastic._steps import LossFn, Steps
from conveyor.runtime import save_checkpoint

__all__ = ["ElasticTrainer"]


class ElasticTrainer:
    """One worker of an elastic job (see the module docstring): its steps (:class:`~conveyor.elastic._steps.Steps`)
    and its backups and recovery (:class:`~conveyor.elastic._handover.Handover`), each given the state it
    changes (:mod:`conveyor.elastic._held`).

    Args:
        model: the whole model, built identically on every worker (a joiner's weights come from its peers).
        loss_fn: ``loss_fn(output, target)``, the mean over the samples.
        make_optimizer: builds an elementwise optimizer from parameters.
        worker: this worker's id (``None``: a joiner, which gets the next free id).
        host, port: the store, which worker 0's launcher hosts.
        options: the tolerances and AgileML's thresholds.
        workers: how many workers the job starts with (worker 0 only).
        log_dir: where ``elastic.jsonl`` and ``metrics.jsonl`` go (worker 0 and the evaluating worker write).
        layout: ``None`` for data parallelism; else the stages and replicas for a number of computing workers
            (:func:`conveyor.elastic.planned_layouts`): an elastic pipeline of the model's blocks, re-planned
            at every generation (:mod:`conveyor.elastic._pipeline`).
        microbatches: a pipeline's microbatches per step (at least the most replicas of a stage).
        device: ``"cpu"`` or ``"cuda"``: where the model computes (worker ``i`` on GPU ``i`` modulo the GPUs; the
            state and every message stay in host memory, :class:`~conveyor.elastic._state.FlatModel`).

    Example (on every worker; see :func:`conveyor.elastic.launch_elastic`)::

        trainer = ElasticTrainer(model, F.cross_entropy, partial(torch.optim.SGD, lr=0.1), worker, host, port)
        result = trainer.fit(ElasticJob(x, y, epochs=5))
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn,
        make_optimizer: Callable[..., torch.optim.Optimizer],
        worker: int | None,
        host: str,
        port: int,
        options: ElasticOptions = ElasticOptions(),
        workers: int = 0,
        log_dir: Path | None = None,
        layout: Callable[[int], StageLayout] | None = None,
        microbatches: int = 4,
        device: str = "cpu",
    ) -> None:
        self.model, self.loss_fn, self.options = model, loss_fn, options
        # Before this worker takes an id, which heartbeats must then follow within lost_s: building an optimizer
        # the first time in a process imports for seconds.
        keys, scalar_keys = state_layout(make_optimizer)
        self.store = connect(host, port, is_leader=False)  # worker 0's launcher hosts it (the reliable tier)
        self.joiner = worker is None
        if worker is None:
            self.store.wait(["next_id"])  # the coordinator has counted the first workers' ids
            worker = self.store.add("next_id", 1) - 1
        self.worker = worker
        self.device = torch.device("cuda", worker % torch.cuda.device_count()) if device == "cuda" else None
        if self.device is not None:
            torch.cuda.set_device(self.device)
            model.to(self.device)
        flat = FlatModel(model)
        self.layout, self.microbatches = layout, microbatches
        self.leader = worker == 0
        self.heartbeat = Heartbeat(host, port, worker=worker, beat_s=options.beat_s)
        self.coordinator = None
        if not self.leader:
            keep_alive(host, port, worker)  # its connection to worker 0 closes when this process dies
        else:
            from conveyor.elastic._membership import Coordinator

            self.store.set("t0", repr(time.time()))
            self.coordinator = Coordinator(
                host,
                port,
                initial=workers,
                reliable=options.reliable,
                lost_s=options.lost_s,
                beat_s=options.beat_s,
                start_s=options.timeout_s,
                sync_max=options.sync_max,
                backup_only_min=options.backup_only_min,
                log=None if log_dir is None else log_dir / "elastic.jsonl",
                liveness=Liveness(host, port),
            )
        listen_for_notice()  # (the launcher listens from the start already)
        self.watch = Watch(
            self.store, host=host, port=port, worker=worker, timeout_s=options.timeout_s, lost_s=options.lost_s
        )
        self.context = WorkerContext(
            worker=worker,
            store=self.store,
            watch=self.watch,
            flat=flat,
            make_optimizer=make_optimizer,
            keys=keys,
            scalar_keys=scalar_keys,
            options=options,
            log_dir=log_dir,
        )
        backup = torch.zeros(self.context.state_numel(), dtype=flat.dtype)
        self.held = HeldState(backup=backup, buffer_bounds=(0, flat.buffer_numel))
        if self.leader:
            self.held.backup[: flat.numel] = flat.weights()
            self.held.backup[self.held.backup.numel() - flat.buffer_numel :] = flat.buffer_vector()
        self.groups = Groups()
        self.first_step_at: float | None = None
        self.losses: deque[float] = deque()  # the last epoch's steps' (bounded: a run may go on for days)

    # ---------------------------------------------------------------- the run
    def fit(self, job: ElasticJob, on_step: Callable[[int], None] | None = None) -> WorkerOutcome:
        """Train until ``job``'s epochs are done (or its target accuracy is reached), whoever comes and goes."""
        if self.device is not None:  # the data moves to the GPU once
            on = {
                k: getattr(job, k).to(self.device)
                for k in ("train_x", "train_y", "test_x", "test_y")
                if getattr(job, k) is not None
            }
            job = dataclasses.replace(job, **on)
        self.job, self.on_step = job, on_step
        staged = StagedStep(self.model, self.microbatches, job.train_x) if self.layout is not None else None
        placement = Placement(self.context.flat, staged, self.layout)
        held, groups = self.held, self.groups
        self.handover = Handover(self.context, held=held, groups=groups, placement=placement, stop_step=self._stop_step)
        self.steps = Steps(
            self.context, held=held, groups=groups, placement=placement, model=self.model, loss_fn=self.loss_fn, job=job
        )
        self.steps_per_epoch = -(-len(job.train_x) // job.batch_size)
        self.losses = deque(maxlen=self.steps_per_epoch)
        self._orders: dict[int, torch.Tensor] = {}
        if self.joiner and NOTICE.is_set():  # revoked while starting: joining would only cost the others a recovery
            print(f"worker {self.worker}: revocation notice before joining: it exits", flush=True)
            self.heartbeat.close()
            return WorkerOutcome(self.worker)
        if self.joiner:  # ask the coordinator to take this worker in at the next step boundary
            n = self.store.add("joins", 1) - 1
            self.store.set(f"join/{n}", str(self.worker))  # the coordinator reads it once it is there
        try:
            while True:
                try:
                    self.handover.recover(self._newest_with_me())
                    self.first_step_at = None
                    self._run_generation()
                    break
                except MembershipChanged:
                    if self.store.check(["finished"]):  # the run ended meanwhile: nothing left to recover for
                        break
                    continue
        except Left:
            return WorkerOutcome(self.worker, events=self.handover.events, left_at=self.done)
        except dist.DistNetworkError as exc:  # the store went away with worker 0
            raise JobFailed(
                f"the job's store on reliable worker 0 is unreachable ({exc}): the reliable tier was "
                "lost, and it must outlive the job"
            ) from None
        finally:
            self.heartbeat.close()
        if self.coordinator is not None:
            self._wait_for_members()
            self.coordinator.close()
        else:
            self.store.set(f"exited/{self.worker}", "1")
        computing = self.watch.gen is not None and self.worker in self.watch.gen.roles.compute
        return WorkerOutcome(
            self.worker,
            steps=self.done + 1,
            losses=list(self.losses),
            events=self.handover.events,
            weights=self.context.flat.weights() if computing else None,
        )

    def _newest_with_me(self) -> Generation:
        while True:
            gen = self.watch.record(self.watch.newest())
            if self.worker in gen.participants:
                return gen
            if self.watch.gen is not None:  # declared lost (paused past the heartbeat limit?): the job went on
                print(f"worker {self.worker} was declared lost and left out of the job: it exits", flush=True)
                # alive: a false loss, logged with what this process's heartbeat did (stalled, or stopped?)
                lost = {"event": "declared lost", "worker": self.worker, "gen": gen.gen}
                self.context.log({**lost, **self.heartbeat.record()})
                raise Left
            time.sleep(0.05)

    @property
    def done(self) -> int:
        """The last step this worker completed."""
        return self.watch.done

    def _stop_step(self) -> int:
        total = self.job.epochs * self.steps_per_epoch
        return min(total, int(self.store.get("stop_step"))) if self.store.check(["stop_step"]) else total

    def _run_generation(self) -> None:
        gen = self.watch.gen
        assert gen is not None
        if self.worker in gen.roles.compute:
            epoch, i = divmod(self.done, self.steps_per_epoch)
            if self.done >= 0 and i == self.steps_per_epoch - 1 and epoch > self.held.evaluated:
                self._end_epoch(epoch, self.done)  # the change came between the epoch's last step and its evaluation
            while self.done + 1 < self._stop_step():
                self.watch.at_boundary()
                self._step(self.done + 1)
            self.watch.at_boundary()  # a planned change pending at the end: make it, then finish together
            if self.worker == gen.roles.compute[0]:
                self._finish()
        elif self.leader and gen.roles.stage == 3:
            self.handover.keep_backups(self.on_step)
        self.watch.poll_until(lambda: self.store.check(["finished"]))

    def _finish(self) -> None:
        if self.context.log_dir is not None:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            save_checkpoint(self.context.log_dir / "checkpoint.pt", state, steps=self.done + 1)
        self.store.set("finished", str(self.done))

    def _wait_for_members(self) -> None:
        gen = self.watch.gen
        assert gen is not None
        others = [w for w in gen.members if w != self.worker]
        deadline = time.monotonic() + 2 * self.options.lost_s + 5
        while time.monotonic() < deadline and not all(self.store.check([f"exited/{w}"]) for w in others):
            time.sleep(0.05)

    # ---------------------------------------------------------------- a step
    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.job.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.job.train_x), generator=generator)}
        return self._orders[epoch]

    def _step(self, t: int) -> None:
        gen = self.watch.gen
        assert gen is not None
        epoch, i = divmod(t, self.steps_per_epoch)
        batch = self._order(epoch)[i * self.job.batch_size : (i + 1) * self.job.batch_size]
        loss = self.steps.run(t, batch)
        self.watch.done = t
        self.losses.append(loss)
        if self.first_step_at is None and self.worker == gen.roles.compute[0]:
            self.first_step_at = time.time()
            self.context.log({"event": "resumed", "gen": gen.gen, "step": t, "worker": self.worker})
        if self.on_step is not None:
            self.on_step(t)
        if i == self.steps_per_epoch - 1 and epoch > self.held.evaluated:  # (not an epoch's end redone after a loss)
            self._end_epoch(epoch, t)
        self.handover.backups(t)

    def _stops_after(self, epoch: int, accuracy: float) -> bool:
        """Whether the run ends with ``epoch``: the target accuracy reached, or the job's own stop (a lease)."""
        target, stop_after = self.job.target_accuracy, self.job.stop_after
        if target is not None and accuracy >= target:
            return True
        return stop_after is not None and stop_after((time.time() - float(self.store.get("t0"))) / (epoch + 1))

    def _end_epoch(self, epoch: int, t: int) -> None:
        gen = self.watch.gen
        assert gen is not None
        if self.layout is not None:
            self.steps.gather_stages()
        accuracy = torch.zeros(1, dtype=torch.float64)
        evaluating = self.worker == gen.roles.compute[0] and self.job.test_x is not None
        if evaluating:
            self.model.eval()
            with torch.no_grad():
                logits = self.model(self.job.test_x)
            accuracy[0] = float((logits.argmax(-1) == self.job.test_y).float().mean())
            if self._stops_after(epoch, float(accuracy)):
                self.store.set("stop_step", str(t + 1))  # before the broadcast: every worker then reads it
            # Logged and marked evaluated before the broadcast: a change may interrupt the broadcast here after a
            # peer received it, and a recovery skips an epoch's end that any participant saw evaluated.
            self._log_epoch(epoch, t, float(accuracy))
            self.held.evaluated = epoch
        self.watch.wait(self.groups.train.broadcast(accuracy, 0), stepping=True)
        self.held.evaluated = epoch

    def _log_epoch(self, epoch: int, t: int, accuracy: float) -> None:
        """The epoch's line of ``metrics.jsonl``, written by the worker that evaluated it."""
        gen = self.watch.gen
        assert gen is not None
        per_epoch = list(self.losses)
        self.context.log(
            {
                "epoch": epoch + 1,
                "seconds": round(time.time() - float(self.store.get("t0")), 3),
                "step": t,
                "loss": sum(per_epoch) / max(1, len(per_epoch)),
                "accuracy": accuracy,
                "gen": gen.gen,
                "workers": len(gen.roles.compute),
            },
            "metrics.jsonl",
        )
