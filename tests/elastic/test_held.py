"""What an elastic worker holds, without processes: its shard one step back and at the step, the buffers of the
last two steps, who holds which part of the state, and the recovery's report as the all-gather carries it."""

import itertools
from functools import partial

import pytest
import torch
from torch import nn

from conveyor.elastic._held import Groups, HeldState, Placement, RecoveryReport
from conveyor.elastic._membership import Generation
from conveyor.elastic._pipeline import StagedStep, StageLayout
from conveyor.elastic._state import FlatModel, ShardOptimizer, full_message_numel
from conveyor.elastic._tiers import roles

SGD = partial(torch.optim.SGD, lr=0.5, momentum=0.9)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def held_shard(flat: FlatModel, bounds: tuple[int, int]) -> HeldState:
    numel = full_message_numel(flat.numel, 1, 0, flat.buffer_numel)
    held = HeldState(backup=torch.zeros(numel), buffer_bounds=(0, flat.buffer_numel), shard_step=0)
    held.shard = ShardOptimizer(flat, SGD, bounds)
    return held


def test_a_shard_is_held_at_its_step_and_the_one_before_with_each_steps_buffers() -> None:
    flat = FlatModel(net())
    held = held_shard(flat, (2, 9))
    at_0 = held.shard_at(0).clone()
    held.keep_step_buffers(1, torch.full((flat.buffer_numel,), 7.0))
    new = held.update_shard(1, torch.ones(7))
    assert torch.equal(new, at_0[:7] - 0.5)  # SGD's first step: w - lr * g (momentum starts at g)
    assert held.shard_step == 1
    assert torch.equal(held.shard_at(0), at_0)
    assert torch.equal(held.shard_at(1)[:7], new)
    assert torch.equal(held.shard_at(1)[-flat.buffer_numel :], torch.full((flat.buffer_numel,), 7.0))
    held.update_shard(2, torch.ones(7))
    with pytest.raises(RuntimeError, match="held at step 2 and the one before, not 0"):
        held.shard_at(0)


def test_only_the_last_two_steps_buffers_are_kept() -> None:
    held = HeldState(backup=torch.zeros(1), buffer_bounds=(0, 0))
    for t in range(4):
        held.keep_step_buffers(t, torch.tensor([float(t)]))
    assert sorted(held.step_buffers) == [2, 3]


def generation(members: tuple[int, ...], reliable: tuple[int, ...], stage: int | None = None) -> Generation:
    return Generation(1, members, (), reliable, roles(members, reliable, stage), planned=True, reason="test")


def test_data_parallel_owners_hold_shards_that_cover_the_weights_each_with_every_buffer() -> None:
    flat = FlatModel(net())
    placement = Placement(flat)
    gen = generation((0, 1, 2), reliable=(0,), stage=2)
    shards = placement.shards(gen)
    assert [holders for holders, _, _ in shards] == [(o,) for o in gen.roles.owners]
    assert shards[0][1][0] == 0 and shards[-1][1][1] == flat.numel
    assert all(a[1][1] == b[1][0] for a, b in itertools.pairwise(shards))
    assert {buffers for _, _, buffers in shards} == {(0, flat.buffer_numel)}
    assert placement.layout_of(gen) is None
    assert placement.backs_up(gen) and not placement.backs_up(generation((0, 1), reliable=(0, 1)))


def test_a_pipelines_stages_are_held_by_their_replicas_and_always_backed_up() -> None:
    model = net()
    layout = StageLayout(balance=(2, 1), replicas=(2, 1))
    placement = Placement(FlatModel(model), StagedStep(model, 2, torch.randn(4, 3)), lambda n: layout)
    gen = generation((0, 1, 2), reliable=(0, 1, 2))
    (first, weights_0, buffers_0), (second, weights_1, _) = placement.shards(gen)
    assert (first, second) == ((0, 1), (2,))
    assert weights_0 == (0, 3 * 4 + 4 + 2 * 4) and weights_1 == (weights_0[1], weights_0[1] + 4 * 2 + 2)
    assert buffers_0 == (0, 8)  # BatchNorm's running mean and variance (its step count is not a float)
    assert placement.layout_of(gen) == {"balance": [2, 1], "replicas": [2, 1]}
    assert placement.backs_up(gen)


def test_a_recovery_report_travels_as_one_tensor() -> None:
    report = RecoveryReport(done=41, owner_gen=3, state_gen=-1, backup_step=40, evaluated=2)
    room = RecoveryReport.empty()
    room.copy_(report.tensor())
    assert RecoveryReport.of(room) == report


def test_retired_groups_keep_the_generations_groups_until_destroyed() -> None:
    groups = Groups(train="train", all="all")
    groups.retire()
    assert (groups.train, groups.all, groups.stage, groups.retired) == (None, None, None, ["train", "all"])
