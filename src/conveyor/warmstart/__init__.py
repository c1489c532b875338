"""Warm starts from trained models (ModelKeeper, NSDI'23): a model store, architecture matching, weights."""

from conveyor.warmstart._graph import OpGraph, OpNode, op_graph
from conveyor.warmstart._match import Alignment, Match, ModelIndex, align, signature
from conveyor.warmstart._store import ModelEntry, ModelStore, default_model_store
from conveyor.warmstart._transform import TransformReport, identity_init, transform, widen_linear_pair
from conveyor.warmstart._warm import WarmStart, apply_warm_start, plan_warm_start

__all__ = [
    "Alignment",
    "Match",
    "ModelEntry",
    "ModelIndex",
    "ModelStore",
    "OpGraph",
    "OpNode",
    "TransformReport",
    "WarmStart",
    "align",
    "apply_warm_start",
    "default_model_store",
    "identity_init",
    "op_graph",
    "plan_warm_start",
    "signature",
    "transform",
    "widen_linear_pair",
]
