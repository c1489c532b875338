"""Profiling a model block by block."""

from functools import partial

import pytest
import torch
from models import branchy
from torch import nn

from conveyor.plan._profiles import Profile
from conveyor.runtime._profiler import profile


def test_sizes_are_exact_and_times_positive() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    p = profile(model, torch.randn(8, 16), repeats=3, warmup=1, optimizer=partial(torch.optim.Adam, lr=1e-3))
    assert p.batch_size == 8 and [layer.name for layer in p.layers] == ["0", "1", "2"]
    assert [layer.output_bytes for layer in p.layers] == [8 * 32 * 4, 8 * 32 * 4, 8 * 4 * 4]
    assert [layer.param_bytes for layer in p.layers] == [(16 * 32 + 32) * 4, 0, (32 * 4 + 4) * 4]
    # Adam keeps two moments per parameter (and a step counter per tensor).
    assert p.layers[0].optimizer_bytes >= 2 * p.layers[0].param_bytes and p.layers[1].optimizer_bytes == 0
    # The first Linear saves its input for the weight gradient; ReLU saves its output.
    assert p.layers[0].saved_bytes == 8 * 16 * 4 and p.layers[1].saved_bytes == 8 * 32 * 4
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in p.layers)
    assert p.edges == ((0, 1), (1, 2))


def test_blocks_exchanging_tuples_and_dicts_can_be_profiled() -> None:
    p = profile(branchy(), torch.randn(4, 8), repeats=1, warmup=0)
    assert len(p) == 4
    assert p.layers[0].output_bytes == 4 * 16 * 4 + 4 * 8 * 4  # (h, x)
    assert p.layers[1].output_bytes == 4 * 16 * 4 + 4 * 8  # {"h": float, "ids": int64}


def test_profile_round_trips_through_json(tmp_path) -> None:
    p = profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), repeats=1, warmup=0)
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_bad_repeat_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile(nn.Sequential(nn.ReLU()), torch.zeros(1, 1), repeats=0)


def test_several_batch_sizes_in_one_profile() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    p = profile(model, torch.zeros(8, 8), repeats=2, warmup=0, batch_sizes=[2, 8, 4])
    assert p.batch_sizes == [8, 2, 4]
    assert [p.at(b).layers[0].output_bytes for b in (2, 4, 8)] == [2 * 16 * 4, 4 * 16 * 4, 8 * 16 * 4]
    assert p.at(2).layers[0].param_bytes == p.layers[0].param_bytes
    with pytest.raises(ValueError, match="between 1 and the example's batch size 8"):
        profile(model, torch.zeros(8, 8), batch_sizes=[16])
