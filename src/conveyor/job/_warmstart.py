"""``conveyor train --warm-start auto|CHECKPOINT`` and ``--register``: a run's model from a stored parent's
weights, and its final model into the store (ModelKeeper)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from conveyor.config import TrainConfig
from conveyor.job._summary import RunSummary
from conveyor.warmstart import ModelStore, WarmStart, apply_warm_start, op_graph, plan_warm_start

__all__ = ["apply_plan", "prepare_warm_start", "register_model"]


def prepare_warm_start(
    cfg: TrainConfig, run_dir: Path, build: Callable[[], nn.Module]
) -> tuple[str | None, dict[str, Any] | None]:
    """Choose the parent once (before the workers start), write the plan to ``run_dir/warm_start.json`` and
    return its path (``None``: no parent to start from), with what the summary gets (``None``: no warm start)."""
    if not cfg.store.warm_start:
        return None, None
    began = time.perf_counter()
    child = build()
    plan, account = plan_warm_start(cfg.store.warm_start, child, ModelStore(cfg.store.folder))
    Console().print(account, markup=False, highlight=False)
    if plan is None:
        return None, {"parent": None, "reason": account, "seconds": time.perf_counter() - began}
    report = apply_warm_start(plan, child, cfg.run.seed)  # as every worker will: for the summary's coverage
    seconds = time.perf_counter() - began  # what a user waits for before the workers start
    path = run_dir / "warm_start.json"
    path.write_text(plan.to_json())
    Console().print(f"the parent's weights cover {report.coverage:.0%} of the model's parameters", highlight=False)
    return str(path), {
        "parent": plan.parent,
        "similarity": plan.score,
        "parent_accuracy": plan.accuracy,
        "coverage": report.coverage,
        "match_s": plan.match_s,
        "seconds": seconds,
        "layers": report.actions,
    }


def apply_plan(plan: str | None, model: nn.Module, seed: int) -> None:
    """In every worker: the same transformation of the parent's weights (``plan``, a warm start's JSON file) into
    the freshly built model."""
    if plan:
        apply_warm_start(WarmStart.from_json(Path(plan).read_text()), model, seed)


def register_model(cfg: TrainConfig, summary: RunSummary, build: Callable[[], nn.Module]) -> RunSummary:
    """With ``--register``: the run's final model, its architecture and final accuracy into the store; the run's
    summary with the model's id."""
    if not cfg.store.register or not summary.accuracy:
        return summary
    graph = json.loads(op_graph(build()).to_json())
    info = {
        "width": cfg.model.width,
        "depth": cfg.model.depth,
        "dataset": cfg.model.dataset,
        "epochs": summary.epochs,
        "run_dir": summary.run_dir,
        "warm_start": (summary.warm_start or {}).get("parent"),
    }
    entry = ModelStore(cfg.store.folder).register(summary.checkpoint, cfg.model.name, summary.accuracy[-1], graph, info)
    return dataclasses.replace(summary, registered=entry.id)
