"""Sharded optimizers update exactly as one optimizer over the whole model, and their state travels whole."""

from functools import partial

import pytest
import torch
from torch import nn

from conveyor.elastic import shard_bounds
from conveyor.elastic._state import FlatModel, ShardOptimizer, cut_shard, full_message_numel, place_shard, state_layout

OPTIMIZERS = {
    "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adam": partial(torch.optim.Adam, lr=0.01),
    "adamw": partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("owners", [1, 3])
def test_shards_update_like_the_whole_model(name: str, owners: int) -> None:
    make = OPTIMIZERS[name]
    whole, sharded = net(), net()
    optimizer, flat = make(whole.parameters()), FlatModel(sharded)
    shards = [ShardOptimizer(flat, make, b) for b in shard_bounds(flat.numel, owners)]
    for step in range(4):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        whole(x).square().mean().backward()
        optimizer.step()
        sharded.zero_grad()
        sharded(x).square().mean().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in flat.params])
        weights = flat.weights()
        for s in shards:
            weights[slice(*s.bounds)] = s.step(grad[slice(*s.bounds)])
        flat.set_weights(weights)
    want = torch.nn.utils.parameters_to_vector(whole.parameters())
    torch.testing.assert_close(flat.weights(), want.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_shard_moves_whole_through_the_full_state(name: str) -> None:
    make, flat = OPTIMIZERS[name], FlatModel(net())
    vectors, scalars = state_layout(make)
    full = torch.zeros(full_message_numel(flat.numel, len(vectors), len(scalars), flat.buffer_numel))
    bounds = shard_bounds(flat.numel, 2)
    source = [ShardOptimizer(flat, make, b) for b in bounds]
    for s in source:  # give the state something to carry
        s.step(torch.randn(s.size, generator=torch.Generator().manual_seed(s.bounds[0])))
        place_shard(
            full,
            s.message(),
            bounds=s.bounds,
            numel=flat.numel,
            vectors=len(vectors),
            buffers=(0, flat.buffer_numel),
            scalars=len(scalars),
        )
    for s in source:
        moved = ShardOptimizer(flat, make, s.bounds)
        moved.load(cut_shard(full, s.bounds, flat.numel, len(vectors)))
        torch.testing.assert_close(moved.message(), s.message())


def test_an_optimizer_with_state_per_tensor_is_refused() -> None:
    class Norms(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["norm"] = [float(p.detach().norm())]
            return super().step(closure)

    with pytest.raises(ValueError, match="elementwise optimizer"):
        state_layout(partial(Norms, lr=0.1))
