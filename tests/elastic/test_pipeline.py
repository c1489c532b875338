"""An elastic pipeline's stages are ranges of the flat weights and buffers, taken in order by the workers the
planner's layout gives them; models it cannot cut fail in one line. (Runs through revocations: see
tests/elastic/test_trainer.py.)"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from conveyor.elastic._pipeline import StagedStep, StageLayout, agreed_layouts
from conveyor.elastic._state import FlatModel


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def test_stages_are_the_blocks_ranges_of_the_flat_weights_and_buffers() -> None:
    net = model()
    flat, staged = FlatModel(net), StagedStep(net, 4, torch.zeros(8, 4))
    layout = StageLayout(balance=(2, 2), replicas=(2, 1))
    shards = staged.shards(layout, (0, 3, 5))
    assert [holders for holders, _, _ in shards] == [(0, 3), (5,)]
    weights, buffers = flat.weights(), flat.buffer_vector()
    blocks = [net[0:2], net[2:4]]
    for (_, (a, b), (ba, bb)), block in zip(shards, blocks, strict=True):
        torch.testing.assert_close(weights[a:b], parameters_to_vector(block.parameters()))
        floats = [x.reshape(-1) for x in block.buffers() if x.is_floating_point()]
        torch.testing.assert_close(buffers[ba:bb], torch.cat(floats) if floats else torch.zeros(0))
    assert shards[-1][1][1] == flat.numel and shards[-1][2][1] == flat.buffer_numel
    stage, first, blocks_of_5 = staged.stage_of(layout, (0, 3, 5), 5)
    assert (stage, first, len(blocks_of_5)) == (1, 2, 2)


def test_receivers_know_each_blocks_input_and_the_probe_moves_no_statistic() -> None:
    net = model()
    before = net[1].running_mean.clone()
    staged = StagedStep(net, 2, torch.randn(8, 4))
    assert [tuple(s) for s in staged.in_shape] == [(4,), (6,), (6,), (6,)]
    torch.testing.assert_close(net[1].running_mean, before)
    assert net.training


def test_models_a_pipeline_cannot_cut_fail_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"cuts an nn\.Sequential"):
        StagedStep(nn.Linear(2, 2), 2, torch.zeros(2, 2))  # type: ignore[arg-type]
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="a block appears twice"):
        StagedStep(nn.Sequential(shared, nn.ReLU(), shared), 2, torch.zeros(2, 3))
    tied = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    tied[2].weight = tied[0].weight
    with pytest.raises(ValueError, match="shared between blocks"):
        StagedStep(tied, 2, torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"one float tensor between blocks, Argmax returns Tensor torch\.int64"):
        StagedStep(nn.Sequential(nn.Linear(3, 3), Argmax(), nn.Embedding(3, 2)), 2, torch.zeros(2, 3))
    staged = StagedStep(model(), 2, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="does not fit 4 blocks on 3 workers"):
        staged.shards(StageLayout((2, 2), (1, 1)), (0, 1, 2))


class Argmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1)


def test_every_worker_runs_the_layout_the_first_one_planned() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=False)
    first = agreed_layouts(lambda n: StageLayout((n,), (1,)), store)
    second = agreed_layouts(lambda n: StageLayout((1, n - 1), (1, 1)), store)  # its planner breaks a tie otherwise
    assert first(3) == second(3) == StageLayout((3,), (1,))
    assert second(4) == first(4) == StageLayout((1, 3), (1, 1))
