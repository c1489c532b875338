"""Planning and applying a warm start: from the store (auto) or a checkpoint, and the plan's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.job import mlp
from conveyor.runtime import save_checkpoint
from conveyor.warmstart import ModelStore, WarmStart, apply_warm_start, op_graph, plan_warm_start


def test_auto_picks_the_stored_parent_and_apply_preserves_its_function(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    assert plan_warm_start("auto", mlp(width=8), store)[0] is None  # nothing stored: from scratch
    torch.manual_seed(0)
    parent = mlp(width=8)
    save_checkpoint(tmp_path / "p.pt", parent.state_dict())
    entry = store.register(tmp_path / "p.pt", "mlp", 0.9, json.loads(op_graph(parent).to_json()))
    child = mlp(width=16)
    plan, account = plan_warm_start("auto", child, store)
    assert plan is not None and plan.parent == entry.id and plan.accuracy == 0.9 and entry.id in account
    assert WarmStart.from_json(plan.to_json()) == plan
    report = apply_warm_start(plan, child)
    x = torch.randn(5, 64)
    assert report.coverage == 1.0
    assert torch.allclose(child(x), parent(x), atol=1e-5)  # widened, the same function


def test_a_checkpoint_pairs_by_name(tmp_path: Path) -> None:
    parent = mlp(width=8)
    save_checkpoint(tmp_path / "p.pt", parent.state_dict())
    plan, _ = plan_warm_start(str(tmp_path / "p.pt"), mlp(width=8, depth=3), ModelStore(tmp_path / "none"))
    assert plan is not None and [a for a, _ in plan.pairs] == ["0", "2", "4"]  # the names both have
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        plan_warm_start(str(tmp_path / "missing.pt"), mlp(), ModelStore(tmp_path / "none"))
