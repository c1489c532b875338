"""What one worker of an elastic job holds, and what the parts of its trainer share.

:class:`ElasticTrainer <conveyor.elastic.ElasticTrainer>` is composed of its steps
(:class:`~conveyor.elastic._steps.Steps`) and its backups and recovery
(:class:`~conveyor.elastic._handover.Handover`); each is given, explicitly, this worker's fixed surroundings
(:class:`WorkerContext`), the state it holds between steps (:class:`HeldState`, which the steps change and a
recovery rebuilds), this generation's process groups (:class:`Groups`) and who holds which part of the state
(:class:`Placement`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from conveyor.elastic._comm import Watch
from conveyor.elastic._job import ElasticOptions
from conveyor.elastic._membership import Generation
from conveyor.elastic._pipeline import Shard, StagedStep, StageLayout
from conveyor.elastic._state import FlatModel, OptimizerFactory, ShardOptimizer, full_message_numel, place_shard
from conveyor.elastic._tiers import shard_bounds

__all__ = ["Groups", "HeldState", "Placement", "RecoveryReport", "Resumption", "WorkerContext"]


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """This worker's surroundings for the whole run: its id, the job's store and its watch on the membership,
    the model as flat vectors, the optimizer's factory and state keys, the options and the run folder."""

    worker: int
    store: Any  # the c10d store (its typing stub lacks check and add)
    watch: Watch
    flat: FlatModel
    make_optimizer: OptimizerFactory
    keys: list[str]  # the optimizer's per-element state
    scalar_keys: list[str]
    options: ElasticOptions
    log_dir: Path | None

    @property
    def leader(self) -> bool:
        """Worker 0: reliable, the store's host, the one that assembles and backs up the whole state."""
        return self.worker == 0

    def log(self, entry: dict[str, Any], file: str = "elastic.jsonl") -> None:
        """Append ``entry`` (stamped with the wall clock) to a log of the run folder, if there is one."""
        if self.log_dir is not None:
            with (self.log_dir / file).open("a") as f:
                f.write(json.dumps({"wall": round(time.time(), 4), **entry}) + "\n")

    def state_numel(self) -> int:
        """Elements of the whole state (:func:`~conveyor.elastic._state.full_message_numel`)."""
        flat = self.flat
        return full_message_numel(flat.numel, len(self.keys), len(self.scalar_keys), flat.buffer_numel)

    def message_room(self, bounds: tuple[int, int]) -> torch.Tensor:
        """Room to receive the :meth:`~conveyor.elastic._state.ShardOptimizer.message` of shard ``bounds``."""
        size = full_message_numel(bounds[1] - bounds[0], len(self.keys), len(self.scalar_keys), self.flat.buffer_numel)
        return torch.zeros(size, dtype=self.flat.dtype)

    def place(self, full: torch.Tensor, message: torch.Tensor, bounds: tuple[int, int], buffers: Any) -> None:
        """A shard's ``message`` into the whole state ``full``."""
        P, V, S = self.flat.numel, len(self.keys), len(self.scalar_keys)
        place_shard(full, message, bounds=bounds, numel=P, vectors=V, buffers=buffers, scalars=S)


@dataclass
class Groups:
    """This generation's process groups (gloo's typing stubs lack their methods), and the earlier ones
    retired until it is safe to destroy them (:meth:`~conveyor.elastic._handover.Handover.recover`)."""

    train: Any = None  # the computing workers'
    all: Any = None  # every member's, for backups
    stage: Any = None  # the replicas of this worker's stage
    retired: list[Any] = field(default_factory=list)

    def retire(self) -> None:
        """The current groups join the retired ones (which alone keep them)."""
        self.retired += [g for g in (self.train, self.all, self.stage) if g is not None]
        self.train = self.all = self.stage = None


@dataclass(frozen=True)
class Placement:
    """Who holds which part of the state in a generation: each owner its shard (data parallelism, ``staged``
    ``None``), or each stage's replicas its weights and buffers (a pipeline, planned by ``layout``)."""

    flat: FlatModel
    staged: StagedStep | None = None
    layout: Callable[[int], StageLayout] | None = None  # a pipeline's layout for a number of computing workers

    def shards(self, gen: Generation) -> list[Shard]:
        if self.staged is None:
            owners, everything = gen.roles.owners, (0, self.flat.buffer_numel)
            bounds = shard_bounds(self.flat.numel, len(owners))
            return [((o,), b, everything) for o, b in zip(owners, bounds, strict=True)]
        return self.staged.shards(self.stage_layout(gen), gen.roles.compute)

    def stage_layout(self, gen: Generation) -> StageLayout:
        assert self.layout is not None
        return self.layout(len(gen.roles.compute))

    def layout_of(self, gen: Generation) -> dict[str, list[int]] | None:
        """A pipeline's blocks and replicas per stage in ``gen`` (``None``: data parallelism)."""
        if self.staged is None:
            return None
        layout = self.stage_layout(gen)
        return {"balance": list(layout.balance), "replicas": list(layout.replicas)}

    def backs_up(self, gen: Generation) -> bool:
        """Whether the reliable tier keeps backups (AgileML's stages 2 and 3; a pipeline's stages always)."""
        return gen.roles.stage > 1 or self.staged is not None


@dataclass(frozen=True, kw_only=True)
class RecoveryReport:
    """What a participant of a recovery tells the others: the last step it completed, the generations whose
    shard it owns and (worker 0) whose owners hold the live state, worker 0's backup step, and the last epoch
    whose evaluation it saw."""

    done: int
    owner_gen: int
    state_gen: int
    backup_step: int
    evaluated: int

    def tensor(self) -> torch.Tensor:
        """The report as the all-gather carries it."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def empty(cls) -> torch.Tensor:
        """Room for a report in the all-gather."""
        return torch.zeros(len(fields(cls)), dtype=torch.float64)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> RecoveryReport:
        """The report an all-gather carried."""
        return cls(**{f.name: int(x) for f, x in zip(fields(cls), tensor.tolist(), strict=True)})


@dataclass(frozen=True, kw_only=True)
class Resumption:
    """Where a recovery resumes: the step, the step the reliable tier had committed, whether the state came
    from its owners (else from worker 0's backup), the steps to redo, and the whole state at the step."""

    step: int
    committed: int
    from_owners: bool
    steps_redone: int
    state: torch.Tensor


@dataclass(kw_only=True)
class HeldState:
    """What a worker holds of the job's state between steps, which its steps change and a recovery rebuilds:
    an owner's shard (weights' slice and optimizer state) and the step it is at (one ahead of the last completed
    step until that step completes everywhere), its shard one step back, the averaged buffers of the last two
    steps, the generation whose shard it owns, the last epoch whose evaluation it saw; and worker 0's backup of
    the whole state, its step, and the generation whose owners hold the live state."""

    backup: torch.Tensor  # worker 0: the whole state at backup_step
    buffer_bounds: tuple[int, int]  # the buffers its shard holds (a stage: its own)
    shard: ShardOptimizer | None = None
    prev: tuple[int, torch.Tensor] | None = None  # the shard's message one step back
    shard_step: int = -1
    step_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    owner_gen: int = -1
    state_gen: int = -1  # worker 0
    evaluated: int = -1  # the last epoch whose evaluation this worker (or a peer, as of the last recovery) saw
    backup_step: int = -1
    sends_backups: bool = False  # whether this worker backs its shard up (a stage's first replica)

    def shard_at(self, c: int) -> torch.Tensor:
        """The shard's message at step ``c``: its last step (which may be one ahead of the last completed step,
        when the step's broadcasts did not complete), or the one before; with step ``c``'s buffers.

        Raises:
            RuntimeError: the shard is at neither.
        """
        assert self.shard is not None
        if self.shard_step == c:
            message = self.shard.message()
        elif self.prev is not None and self.prev[0] == c:
            message = self.prev[1]
        else:
            raise RuntimeError(f"the shard is held at step {self.shard_step} and the one before, not {c}")
        buffer_numel = self.shard.flat.buffer_numel
        if buffer_numel and c in self.step_buffers:  # the model's own may be mid-step
            message = message.clone()
            message[message.numel() - buffer_numel :] = self.step_buffers[c]
        return message

    def update_shard(self, t: int, grad: torch.Tensor) -> torch.Tensor:
        """Apply step ``t``'s mean gradient to the shard, keeping its message of the step before (the step may
        not complete everywhere: :meth:`shard_at` hands over either); return the shard's new weights."""
        assert self.shard is not None
        self.prev = (t - 1, self.shard_at(t - 1).clone())
        new = self.shard.step(grad)
        self.shard_step = t  # ahead of the last completed step until this one completes
        return new

    def keep_step_buffers(self, t: int, buffers: torch.Tensor) -> None:
        """Step ``t``'s averaged buffers, kept with the step before's."""
        self.step_buffers = {k: v for k, v in self.step_buffers.items() if k == t - 1}
        self.step_buffers[t] = buffers
