"""How state moves between workers: an owner's backups to the reliable tier, and a generation's recovery.

A mixin of :class:`conveyor.elastic.ElasticTrainer` (see its module for the equations and the bounds): the
backups of stages 2 and 3, and the recovery every participant of a new generation runs, in which worker 0
assembles the whole state at the committed step and broadcasts it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from conveyor.elastic._comm import Waiting, Watch, destroy_groups
from conveyor.elastic._membership import ALL_GROUP, RECOVER_GROUP, TRAIN_GROUP, Generation, stage_group
from conveyor.elastic._pipeline import Shard
from conveyor.elastic._state import FlatModel, ShardOptimizer, cut_shard, full_message_numel, place_shard

__all__ = ["Handover", "HeldState", "Left", "RecoveryReport", "Resumption"]


class Left(Exception):
    pass


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


class Handover:
    """Backups and recovery; the attributes are the trainer's, the state it holds in ``held``."""

    held: HeldState

    worker: int
    leader: bool
    store: Any
    watch: Watch
    flat: FlatModel
    keys: list[str]
    scalar_keys: list[str]
    make_optimizer: Callable[..., torch.optim.Optimizer]
    options: Any
    log_dir: Path | None
    train_group: Any
    all_group: Any
    stage_group: Any
    staged: Any
    pending_send: Waiting | None
    incoming: list[tuple[int, list[tuple[Shard, torch.Tensor, Waiting | None]]]]
    first_step_at: float | None
    retired: list[Any]
    events: list[dict[str, Any]]
    on_step: Callable[[int], None] | None

    @property
    def done(self) -> int:
        """The last step this worker completed."""
        return self.watch.done

    def log(self, entry: dict[str, Any], file: str = "elastic.jsonl") -> None:
        """Append ``entry`` (stamped with the wall clock) to a log of the run folder, if there is one."""
        if self.log_dir is not None:
            with (self.log_dir / file).open("a") as f:
                f.write(json.dumps({"wall": round(time.time(), 4), **entry}) + "\n")

    def _stop_step(self) -> int:
        raise NotImplementedError  # the trainer's

    def shards(self, gen: Generation) -> list[Shard]:
        raise NotImplementedError  # the trainer's

    def backs_up(self, gen: Generation) -> bool:
        raise NotImplementedError  # the trainer's

    def layout_of(self, gen: Generation) -> dict[str, list[int]] | None:
        raise NotImplementedError  # the trainer's

    # ---------------------------------------------------------------- backups (stages 2 and 3)
    def _backups(self, t: int) -> None:
        """An owner sends its shard to worker 0 every ``backup_every`` steps, waiting only for its previous
        backup; worker 0, when it computes, posts the receives at the same steps and installs complete ones."""
        gen = self.watch.gen
        assert gen is not None
        if not self.backs_up(gen) or t % self.options.backup_every:
            return
        if self.held.sends_backups and self.held.shard is not None and not self.leader:
            if self.pending_send is not None:
                self.watch.wait(self.pending_send, between_steps=True)  # worker 0 may be in a recovery
            self.send_buffer = self.held.shard.message().clone()
            self.pending_send = Waiting(self.all_group.send([self.send_buffer], gen.members.index(0), t))
        if self.leader:
            self._post_backup(t)
            self._install_backups(block=False)

    def _post_backup(self, t: int) -> None:
        gen = self.watch.gen
        assert gen is not None
        posts: list[tuple[Shard, torch.Tensor, Waiting | None]] = []
        for shard in self.shards(gen):
            (o, *_), (lo, hi), _ = shard
            if o == self.worker:  # worker 0's own stage of a pipeline: no message to itself
                posts.append((shard, self._shard_at(t).clone(), None))
                continue
            buffer = self._message_for((lo, hi))
            posts.append((shard, buffer, Waiting(self.all_group.recv([buffer], gen.members.index(o), t))))
        self.incoming.append((t, posts))

    def _install_backups(self, block: bool) -> None:
        while self.incoming:
            t, posts = self.incoming[0]
            works = [work for _, _, work in posts if work is not None]
            if block:
                for work in works:
                    self.watch.wait(work)
            elif not all(work.ready() for work in works):
                return
            if any(work.error is not None for work in works):
                return  # an owner was lost mid-backup: the generation is about to change
            P, V, S = self.flat.numel, len(self.keys), len(self.scalar_keys)
            for (_, bounds, buffers), message, _ in posts:
                place_shard(self.held.backup, message, bounds=bounds, numel=P, vectors=V, buffers=buffers, scalars=S)
            self.held.backup_step = t
            self.incoming.pop(0)

    def _keep_backups(self) -> None:
        """Worker 0 in stage 3: receive the owners' backups, one backup step at a time, until the run ends."""
        L = self.options.backup_every
        t = (self.done // L + 1) * L
        while not self.store.check(["finished"]) and t < self._stop_step():
            self._post_backup(t)
            self.watch.poll_until(lambda: self.store.check(["finished"]) or self._arrived())
            if not self._arrived():
                return
            self._install_backups(block=True)
            if self.on_step is not None:  # worker 0 computes nothing in stage 3: its progress is the backups'
                self.on_step(t)
            t += L

    def _message_for(self, bounds: tuple[int, int]) -> torch.Tensor:
        """Room to receive the :meth:`~conveyor.elastic._state.ShardOptimizer.message` of shard ``bounds``."""
        size = full_message_numel(bounds[1] - bounds[0], len(self.keys), len(self.scalar_keys), self.flat.buffer_numel)
        return torch.zeros(size, dtype=self.flat.dtype)

    def _arrived(self) -> bool:
        return all(w is None or w.ready() for _, _, w in self.incoming[0][1])

    # ---------------------------------------------------------------- recovery
    def _recover(self, gen: Generation) -> None:
        """Meet every participant of ``gen``, resume from the committed state, and build its groups."""
        began = time.time()
        group, seen = self._meet(gen)
        resumption = self._assemble(gen, group, seen)
        held_now = self._resume(gen, resumption)
        if self.leader:
            self._record_generation(gen, resumption, recover_s=time.time() - began)
        if self.worker in gen.leaving:
            self.store.set(f"left/{self.worker}", str(gen.gen))
            raise Left
        self._build_groups(gen, held_now)

    def _meet(self, gen: Generation) -> tuple[Any, dict[int, RecoveryReport]]:
        """Every participant's report, by worker, through the recovery's own group (which is returned)."""
        self.watch.gen, self.first_step_at = gen, None
        if self.leader:
            self._install_backups(block=False)  # those already arrived: a fresher backup to fall back on
        self.pending_send, self.incoming = None, []
        parts = gen.participants
        group: Any = self.watch.group(RECOVER_GROUP, parts)
        earlier = len(self.retired)
        self.retired.append(group)  # destroyed once the participants have met in a later recovery
        mine = RecoveryReport(
            done=self.done,
            owner_gen=self.held.owner_gen,
            state_gen=self.held.state_gen,
            backup_step=self.held.backup_step,
            evaluated=self.held.evaluated,
        )
        reports = [RecoveryReport.empty() for _ in parts]
        self.watch.wait(group.allgather([reports], [mine.tensor()]))
        # Every participant is here, so done with the groups retired before: destroy them (a peer still in one
        # would lose what it had yet to receive when this worker's sockets close).
        destroy_groups([self.retired.pop(0) for _ in range(earlier)])
        return group, {w: RecoveryReport.of(r) for w, r in zip(parts, reports, strict=True)}

    def _assemble(self, gen: Generation, group: Any, seen: dict[int, RecoveryReport]) -> Resumption:
        """The whole state at the step to resume from, assembled on worker 0 from its holders (or its backup)
        and broadcast to every participant."""
        state_gen, backup_step = seen[0].state_gen, seen[0].backup_step
        # An epoch's end redone after a loss is not evaluated again if any participant saw it evaluated (decided
        # from what all of them reported, so they all skip it or none does: it holds a collective).
        self.held.evaluated = max(r.evaluated for r in seen.values())
        held = self.shards(self.watch.record(state_gen)) if state_gen >= 0 else []
        # Each shard from the first of its holders (its owner, or any replica of a stage) still holding it.
        sources = [
            next((h for h in holders if h in seen and seen[h].owner_gen == state_gen), -1) for holders, _, _ in held
        ]
        from_owners = bool(held) and -1 not in sources
        c = min(seen[o].done for o in sources) if from_owners else backup_step
        # Committed: held by the reliable tier (every step it owns in stage 1; its backups otherwise).
        committed = c if from_owners and all(o in gen.reliable for o in sources) else backup_step
        full = torch.zeros_like(self.held.backup)
        if from_owners:
            parts = gen.participants
            for o, (_, shard, buffers) in zip(sources, held, strict=True):
                if o == self.worker == 0:
                    self._place(full, self._shard_at(c), shard, buffers)
                elif o == self.worker:
                    self.watch.wait(group.send([self._shard_at(c)], parts.index(0), 0))
                elif self.leader:
                    message = self._message_for(shard)
                    self.watch.wait(group.recv([message], parts.index(o), 0))
                    self._place(full, message, shard, buffers)
        elif self.leader:
            full.copy_(self.held.backup)
        if self.leader:
            self.held.backup.copy_(full)
            self.held.backup_step = c
        self.watch.wait(group.broadcast(full, gen.participants.index(0)))
        redone = max(r.done for r in seen.values()) - c
        return Resumption(step=c, committed=committed, from_owners=from_owners, steps_redone=redone, state=full)

    def _place(self, full: torch.Tensor, message: torch.Tensor, shard: tuple[int, int], buffers: Any) -> None:
        """An owner's shard ``message`` into the whole state ``full``."""
        P, V, S = self.flat.numel, len(self.keys), len(self.scalar_keys)
        place_shard(full, message, bounds=shard, numel=P, vectors=V, buffers=buffers, scalars=S)

    def _resume(self, gen: Generation, resumption: Resumption) -> list[tuple[int, Any, Any, Any]]:
        """Weights, buffers and this worker's shard of ``gen`` from the assembled state; the shards it holds."""
        c, full, P = resumption.step, resumption.state, self.flat.numel
        self.flat.set_weights(full[:P])
        self.flat.set_buffers(full[full.numel() - self.flat.buffer_numel :])
        self.watch.done, self.held.prev, self.held.shard, self.held.shard_step = c, None, None, c
        self.held.step_buffers = {c: full[full.numel() - self.flat.buffer_numel :].clone()}
        held_now = [(s, *shard) for s, shard in enumerate(self.shards(gen)) if self.worker in shard[0]]
        self.held.sends_backups = False
        for _, holders, shard, buffers in held_now:
            self.held.shard = ShardOptimizer(self.flat, self.make_optimizer, shard)
            self.held.shard.load(cut_shard(full, shard, P, len(self.keys)))
            self.held.buffer_bounds, self.held.sends_backups = buffers, holders[0] == self.worker
        self.held.owner_gen = gen.gen if self.held.shard is not None else -1
        return held_now

    def _record_generation(self, gen: Generation, resumption: Resumption, *, recover_s: float) -> None:
        """Worker 0: the generation is the live state's now, in the store and in elastic.jsonl."""
        if self.log_dir is not None:
            (self.log_dir / "training-started").touch()  # an emulated cluster's fault clock starts here
        self.held.state_gen = gen.gen
        self.store.set("state_gen", str(gen.gen))  # the coordinator keeps this generation's record
        event = {
            "event": "generation",
            "gen": gen.gen,
            "reason": gen.reason,
            "planned": gen.planned,
            "members": list(gen.members),
            "leaving": list(gen.leaving),
            "stage": gen.roles.stage,
            "compute": list(gen.roles.compute),
            "owners": list(gen.roles.owners),
            "resume_step": resumption.step,
            "layout": self.layout_of(gen),
            "committed": resumption.committed,
            "steps_redone": resumption.steps_redone,
            "from": "owners" if resumption.from_owners else "backup",
            "recover_s": round(recover_s, 4),
        }
        self.events.append(event)
        self.log(event)

    def _build_groups(self, gen: Generation, held_now: list[tuple[int, Any, Any, Any]]) -> None:
        """The process groups of ``gen``: the computing workers', a stage's replicas', everyone's for backups."""
        self.retired += [g for g in (self.train_group, self.all_group, self.stage_group) if g is not None]
        self.train_group = self.all_group = self.stage_group = None  # the retired list holds them alone
        if self.worker in gen.roles.compute:
            self.train_group = self.watch.group(TRAIN_GROUP, gen.roles.compute)
            if self.staged is not None and len(held_now[0][1]) > 1:  # the replicas of this worker's stage
                self.stage_group = self.watch.group(stage_group(held_now[0][0]), held_now[0][1])
        if self.backs_up(gen):
            self.all_group = self.watch.group(ALL_GROUP, gen.members)

    def _shard_at(self, c: int) -> torch.Tensor:
        """This owner's shard message at step ``c``: its shard's last step (which may be one ahead of ``done``,
        when the step's broadcasts did not complete), or the one before; with step ``c``'s buffers."""
        assert self.held.shard is not None
        if self.held.shard_step == c:
            message = self.held.shard.message()
        elif self.held.prev is not None and self.held.prev[0] == c:
            message = self.held.prev[1]
        else:
            raise RuntimeError(
                f"worker {self.worker} holds its shard at step {self.held.shard_step} and the one before, not {c}"
            )
        if self.flat.buffer_numel and c in self.held.step_buffers:  # the model's own may be mid-step
            message = message.clone()
            message[message.numel() - self.flat.buffer_numel :] = self.held.step_buffers[c]
        return message
