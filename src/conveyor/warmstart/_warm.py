"""A warm start: choose a parent for a new model (from the store, or a given checkpoint) and transform its weights."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.errors import InputError
from conveyor.warmstart._graph import OpGraph, op_graph
from conveyor.warmstart._match import ModelIndex
from conveyor.warmstart._store import ModelStore
from conveyor.warmstart._transform import TransformReport, transform

__all__ = ["WarmStart", "apply_warm_start", "plan_warm_start"]


@dataclass(frozen=True)
class WarmStart:
    """The parent chosen for a child model: its checkpoint, the layer pairs, how alike they are, and how long
    choosing took (``match_s``: reading the store's graphs and matching, not tracing the child)."""

    parent: str  # a stored model's id, or the checkpoint's path
    checkpoint: str
    pairs: list[tuple[str, str]]
    score: float
    accuracy: float | None  # the parent's, when stored
    match_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WarmStart:
        data = json.loads(text)
        return cls(**{**data, "pairs": [tuple(p) for p in data["pairs"]]})


def plan_warm_start(spec: str, child: nn.Module, store: ModelStore, *, w: float = 1.0) -> tuple[WarmStart | None, str]:
    """For ``spec`` ``auto`` the store's best parent for ``child`` (similarity x accuracy**w, see
    :class:`ModelIndex`); otherwise ``spec`` is a checkpoint whose layers pair with the child's by name.
    Returns the plan, or None, and a one-line account."""
    graph = op_graph(child)
    if spec != "auto":
        state = _state(Path(spec))
        owners = {key.rsplit(".", 1)[0] for key in state}
        pairs = [(n.name, n.name) for n in graph.nodes if n.params and n.name in owners]
        pairs = list(dict.fromkeys(pairs))
        plan = WarmStart(spec, spec, pairs, len(pairs) / max(1, sum(1 for n in graph.nodes if n.params)), None, 0.0)
        return plan, f"warm start from {spec}: {len(pairs)} layers pair by name"
    began = time.perf_counter()
    index = ModelIndex()
    for entry in store.list():
        index.add(entry.id, OpGraph.from_json(json.dumps(entry.graph)), entry.accuracy)
    match = index.best(graph, w=w)
    spent = time.perf_counter() - began
    if match.parent is None or match.alignment is None:
        return None, f"no warm start: {match.reason}; training from scratch"
    parent = store.get(match.parent)
    plan = WarmStart(
        parent.id,
        str(store.checkpoint(parent.id)),
        match.alignment.pairs,
        match.alignment.score,
        parent.accuracy,
        spent,
    )
    return plan, (
        f"warm start from {parent.id} ({parent.name}, accuracy {parent.accuracy:.3f}, similarity "
        f"{match.alignment.score:.2f}; {len(index)} stored models matched in {spent * 1000:.0f} ms)"
    )


def apply_warm_start(plan: WarmStart, child: nn.Module, seed: int = 0) -> TransformReport:
    """Transform the parent's weights into ``child`` (in place; deterministic for ``seed``, so every worker of a
    job that applies the same plan gets the same weights)."""
    return transform(_state(Path(plan.checkpoint)), child, plan.pairs, seed=seed)


def _state(path: Path) -> dict[str, Any]:
    """The model weights of a Conveyor checkpoint (``{"model": state}``) or of a plain state dict file."""
    from conveyor.runtime import load_checkpoint

    try:
        return dict(load_checkpoint(path)["model"])
    except Exception:  # not a Conveyor checkpoint: a plain state dict saved with torch.save
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path} to warm-start from: check the path") from None
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InputError(f"{path} is neither a Conveyor checkpoint nor a state dict: give one") from None
        return state
