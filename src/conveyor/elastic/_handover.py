"""How state moves between workers: an owner's backups to the reliable tier, and a generation's recovery.

A part of :class:`conveyor.elastic.ElasticTrainer` (see its module for the equations and the bounds), given the
state it moves explicitly (:mod:`conveyor.elastic._held`): the backups of stages 2 and 3, and the recovery
every participant of a new generation runs, in which worker 0 assembles the whole state at the committed step
and broadcasts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.elastic._comm import Waiting, destroy_groups
from conveyor.elastic._held import Groups, HeldState, Placement, RecoveryReport, Resumption, WorkerContext
from conveyor.elastic._membership import ALL_GROUP, RECOVER_GROUP, TRAIN_GROUP, Generation, stage_group
from conveyor.elastic._pipeline import Shard
from conveyor.elastic._state import ShardOptimizer, cut_shard

__all__ = ["Handover", "Left"]


class Left(Exception):
    """This worker leaves the job (its notice's generation left it out, or it was declared lost)."""


class Handover:
    """Backups and recovery of one worker.

    Args:
        context: this worker's surroundings.
        held: the state it holds, which a recovery rebuilds and a backup sends.
        groups: this generation's process groups, which a recovery replaces.
        placement: who holds which part of the state.
        stop_step: the step the run stops before (it may come sooner: a target reached, a lease).
    """

    def __init__(
        self,
        context: WorkerContext,
        *,
        held: HeldState,
        groups: Groups,
        placement: Placement,
        stop_step: Callable[[], int],
    ) -> None:
        self.context, self.held, self.groups, self.placement = context, held, groups, placement
        self.stop_step = stop_step
        self.pending_send: Waiting | None = None  # an owner's backup on its way to worker 0
        self.send_buffer: torch.Tensor | None = None
        self.incoming: list[tuple[int, list[tuple[Shard, torch.Tensor, Waiting | None]]]] = []  # worker 0's
        self.events: list[dict[str, Any]] = []  # the generations this worker recorded (worker 0)

    # ---------------------------------------------------------------- backups (stages 2 and 3)
    def backups(self, t: int) -> None:
        """An owner sends its shard to worker 0 every ``backup_every`` steps, waiting only for its previous
        backup; worker 0, when it computes, posts the receives at the same steps and installs complete ones."""
        ctx, held = self.context, self.held
        gen = ctx.watch.gen
        assert gen is not None
        if not self.placement.backs_up(gen) or t % ctx.options.backup_every:
            return
        if held.sends_backups and held.shard is not None and not ctx.leader:
            if self.pending_send is not None:
                ctx.watch.wait(self.pending_send, between_steps=True)  # worker 0 may be in a recovery
            self.send_buffer = held.shard.message().clone()
            self.pending_send = Waiting(self.groups.all.send([self.send_buffer], gen.members.index(0), t))
        if ctx.leader:
            self._post_backup(t)
            self._install_backups(block=False)

    def keep_backups(self, on_step: Callable[[int], None] | None) -> None:
        """Worker 0 in stage 3: receive the owners' backups, one backup step at a time, until the run ends."""
        ctx = self.context
        L = ctx.options.backup_every
        t = (ctx.watch.done // L + 1) * L
        while not ctx.store.check(["finished"]) and t < self.stop_step():
            self._post_backup(t)
            ctx.watch.poll_until(lambda: ctx.store.check(["finished"]) or self._arrived())
            if not self._arrived():
                return
            self._install_backups(block=True)
            if on_step is not None:  # worker 0 computes nothing in stage 3: its progress is the backups'
                on_step(t)
            t += L

    def _post_backup(self, t: int) -> None:
        ctx = self.context
        gen = ctx.watch.gen
        assert gen is not None
        posts: list[tuple[Shard, torch.Tensor, Waiting | None]] = []
        for shard in self.placement.shards(gen):
            (o, *_), bounds, _ = shard
            if o == ctx.worker:  # worker 0's own stage of a pipeline: no message to itself
                posts.append((shard, self.held.shard_at(t).clone(), None))
                continue
            buffer = ctx.message_room(bounds)
            posts.append((shard, buffer, Waiting(self.groups.all.recv([buffer], gen.members.index(o), t))))
        self.incoming.append((t, posts))

    def _install_backups(self, block: bool) -> None:
        while self.incoming:
            t, posts = self.incoming[0]
            works = [work for _, _, work in posts if work is not None]
            if block:
                for work in works:
                    self.context.watch.wait(work)
            elif not all(work.ready() for work in works):
                return
            if any(work.error is not None for work in works):
                return  # an owner was lost mid-backup: the generation is about to change
            for (_, bounds, buffers), message, _ in posts:
                self.context.place(self.held.backup, message, bounds, buffers)
            self.held.backup_step = t
            self.incoming.pop(0)

    def _arrived(self) -> bool:
        return all(w is None or w.ready() for _, _, w in self.incoming[0][1])

    # ---------------------------------------------------------------- recovery
    def recover(self, gen: Generation) -> None:
        """Meet every participant of ``gen``, resume from the committed state, and build its groups.

        Raises:
            Left: ``gen`` leaves this worker out (after it handed its shard over).
        """
        ctx = self.context
        began = time.time()
        group, seen = self._meet(gen)
        resumption = self._assemble(gen, group, seen)
        held_now = self._resume(gen, resumption)
        if ctx.leader:
            self._record_generation(gen, resumption, recover_s=time.time() - began)
        if ctx.worker in gen.leaving:
            ctx.store.set(f"left/{ctx.worker}", str(gen.gen))
            raise Left
        self._build_groups(gen, held_now)

    def _meet(self, gen: Generation) -> tuple[Any, dict[int, RecoveryReport]]:
        """Every participant's report, by worker, through the recovery's own group (which is returned)."""
        ctx, held = self.context, self.held
        ctx.watch.gen = gen
        if ctx.leader:
            self._install_backups(block=False)  # those already arrived: a fresher backup to fall back on
        self.pending_send, self.incoming = None, []
        parts = gen.participants
        group: Any = ctx.watch.group(RECOVER_GROUP, parts)
        earlier = len(self.groups.retired)
        self.groups.retired.append(group)  # destroyed once the participants have met in a later recovery
        mine = RecoveryReport(
            done=ctx.watch.done,
            owner_gen=held.owner_gen,
            state_gen=held.state_gen,
            backup_step=held.backup_step,
            evaluated=held.evaluated,
        )
        reports = [RecoveryReport.empty() for _ in parts]
        ctx.watch.wait(group.allgather([reports], [mine.tensor()]))
        # Every participant is here, so done with the groups retired before: destroy them (a peer still in one
        # would lose what it had yet to receive when this worker's sockets close).
        destroy_groups([self.groups.retired.pop(0) for _ in range(earlier)])
        return group, {w: RecoveryReport.of(r) for w, r in zip(parts, reports, strict=True)}

    def _assemble(self, gen: Generation, group: Any, seen: dict[int, RecoveryReport]) -> Resumption:
        """The whole state at the step to resume from, assembled on worker 0 from its holders (or its backup)
        and broadcast to every participant."""
        ctx, held = self.context, self.held
        state_gen, backup_step = seen[0].state_gen, seen[0].backup_step
        # An epoch's end redone after a loss is not evaluated again if any participant saw it evaluated (decided
        # from what all of them reported, so they all skip it or none does: it holds a collective).
        held.evaluated = max(r.evaluated for r in seen.values())
        shards = self.placement.shards(ctx.watch.record(state_gen)) if state_gen >= 0 else []
        # Each shard from the first of its holders (its owner, or any replica of a stage) still holding it.
        sources = [
            next((h for h in holders if h in seen and seen[h].owner_gen == state_gen), -1) for holders, _, _ in shards
        ]
        from_owners = bool(shards) and -1 not in sources
        c = min(seen[o].done for o in sources) if from_owners else backup_step
        # Committed: held by the reliable tier (every step it owns in stage 1; its backups otherwise).
        committed = c if from_owners and all(o in gen.reliable for o in sources) else backup_step
        full = torch.zeros_like(held.backup)
        if from_owners:
            parts = gen.participants
            for o, (_, bounds, buffers) in zip(sources, shards, strict=True):
                if o == ctx.worker == 0:
                    ctx.place(full, held.shard_at(c), bounds, buffers)
                elif o == ctx.worker:
                    ctx.watch.wait(group.send([held.shard_at(c)], parts.index(0), 0))
                elif ctx.leader:
                    message = ctx.message_room(bounds)
                    ctx.watch.wait(group.recv([message], parts.index(o), 0))
                    ctx.place(full, message, bounds, buffers)
        elif ctx.leader:
            full.copy_(held.backup)
        if ctx.leader:
            held.backup.copy_(full)
            held.backup_step = c
        ctx.watch.wait(group.broadcast(full, gen.participants.index(0)))
        redone = max(r.done for r in seen.values()) - c
        return Resumption(step=c, committed=committed, from_owners=from_owners, steps_redone=redone, state=full)

    def _resume(self, gen: Generation, resumption: Resumption) -> list[tuple[int, Any, Any, Any]]:
        """Weights, buffers and this worker's shard of ``gen`` from the assembled state; the shards it holds."""
        ctx, held = self.context, self.held
        flat, c, full = ctx.flat, resumption.step, resumption.state
        buffers = full[full.numel() - flat.buffer_numel :]
        flat.set_weights(full[: flat.numel])
        flat.set_buffers(buffers)
        ctx.watch.done, held.prev, held.shard, held.shard_step = c, None, None, c
        held.step_buffers = {c: buffers.clone()}
        held_now = [(s, *shard) for s, shard in enumerate(self.placement.shards(gen)) if ctx.worker in shard[0]]
        held.sends_backups = False
        for _, holders, bounds, buffer_bounds in held_now:
            held.shard = ShardOptimizer(flat, ctx.make_optimizer, bounds)
            held.shard.load(cut_shard(full, bounds, flat.numel, len(ctx.keys)))
            held.buffer_bounds, held.sends_backups = buffer_bounds, holders[0] == ctx.worker
        held.owner_gen = gen.gen if held.shard is not None else -1
        return held_now

    def _record_generation(self, gen: Generation, resumption: Resumption, *, recover_s: float) -> None:
        """Worker 0: the generation is the live state's now, in the store and in elastic.jsonl."""
        ctx = self.context
        if ctx.log_dir is not None:
            (ctx.log_dir / "training-started").touch()  # an emulated cluster's fault clock starts here
        self.held.state_gen = gen.gen
        ctx.store.set("state_gen", str(gen.gen))  # the coordinator keeps this generation's record
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
            "layout": self.placement.layout_of(gen),
            "committed": resumption.committed,
            "steps_redone": resumption.steps_redone,
            "from": "owners" if resumption.from_owners else "backup",
            "recover_s": round(recover_s, 4),
        }
        self.events.append(event)
        ctx.log(event)

    def _build_groups(self, gen: Generation, held_now: list[tuple[int, Any, Any, Any]]) -> None:
        """The process groups of ``gen``: the computing workers', a stage's replicas', everyone's for backups."""
        ctx, groups = self.context, self.groups
        groups.retire()
        if ctx.worker in gen.roles.compute:
            groups.train = ctx.watch.group(TRAIN_GROUP, gen.roles.compute)
            if self.placement.staged is not None and len(held_now[0][1]) > 1:  # the replicas of this worker's stage
                groups.stage = ctx.watch.group(stage_group(held_now[0][0]), held_now[0][1])
        if self.placement.backs_up(gen):
            groups.all = ctx.watch.group(ALL_GROUP, gen.members)
