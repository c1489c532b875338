"""Where a traced model's graph is cut into blocks: runs of operations that belong to the same submodule, the
heaviest refined into its children's runs until there are enough for the planner; a shape computation goes
with its tensor; another graph of the same model (its evaluation) is cut alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from conveyor.errors import InputError

__all__ = ["Segment", "cut", "cut_alike"]


@dataclass
class Segment:
    key: str  # the submodule its operations belong to ("" for the model's own forward)
    level: int  # how deep in the module tree the key is
    nodes: list[fx.Node] = field(default_factory=list)


def _module_paths(node: fx.Node) -> list[str]:
    """The submodules a node runs in, outermost first, without the model itself."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if path]


def _key(node: fx.Node, level: int) -> str:
    paths = _module_paths(node)
    return paths[level - 1] if len(paths) >= level else ""


def _segments(nodes: list[fx.Node], level: int) -> list[Segment]:
    """Runs of consecutive ``nodes`` under the same submodule at ``level``; an operation of an enclosing module
    (a residual add) joins the run before it."""
    segments: list[Segment] = []
    for node in nodes:
        key = _key(node, level)
        if segments and (key == segments[-1].key or not key):
            segments[-1].nodes.append(node)
        else:
            segments.append(Segment(key, level, [node]))
    return segments


def _refine(segments: list[Segment], key: str) -> list[Segment]:
    """``segments`` with each one under ``key`` cut into its children's runs."""
    out: list[Segment] = []
    for segment in segments:
        if segment.key != key:
            out.append(segment)
            continue
        parts = _segments(segment.nodes, segment.level + 1)
        for part in parts:  # the module's own operations before its first child keep its key
            part.key = part.key or key
        out += parts
    return out


def _cut(nodes: list[fx.Node], weights: dict[str, int], target: int) -> tuple[list[Segment], list[str]]:
    """Segments at the top level, the heaviest (by parameters, then operations) refined into its children
    until there are ``target`` or none can be; also the keys refined, in order, to cut another graph alike."""
    segments, refined = _segments(nodes, 1), []
    while len(segments) < target:
        deeper = [s for s in segments if s.key and any(len(_module_paths(n)) > s.level for n in s.nodes)]
        if not deeper:
            break
        big = max(deeper, key=lambda s: (weights.get(s.key, 0), len(s.nodes)))
        refined.append(big.key)
        segments = _refine(segments, big.key)
    return segments, refined


def _is_shape(node: fx.Node) -> bool:
    """Whether ``node`` computes a number from shapes (a batch size traced as dynamic), not a tensor."""
    return isinstance(node.meta.get("val"), int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool)


def _with_shapes(ops: list[fx.Node], parts: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """``parts`` (of the tensor operations) with each shape computation in the part of its last input, so that
    a size is read where its tensor is and only the number crosses the cuts after it."""
    part_of = {node: i for i, part in enumerate(parts) for node in part}
    for node in ops:
        if _is_shape(node):
            part_of[node] = max((part_of[n] for n in node.all_input_nodes if n in part_of), default=0)
    placed: list[list[fx.Node]] = [[] for _ in parts]
    for node in ops:
        placed[part_of[node]].append(node)
    return placed


def _replay(nodes: list[fx.Node], refined: list[str]) -> list[Segment]:
    segments = _segments(nodes, 1)
    for key in refined:
        segments = _refine(segments, key)
    return segments


def _align(train: list[Segment], other: list[Segment]) -> list[list[fx.Node]]:
    """``other``'s operations per segment of ``train``: the same keys in the same order, where a submodule that
    runs no operation in ``other`` (dropout in evaluation) has an empty part.

    Raises:
        InputError: ``other`` runs submodules in an order ``train`` does not.
    """
    parts: list[list[fx.Node]] = []
    at = 0
    for segment in train:
        if at < len(other) and (other[at].key, other[at].level) == (segment.key, segment.level):
            parts.append(other[at].nodes)
            at += 1
        else:
            parts.append([])
    if at < len(other):
        raise InputError(
            f"the model runs {other[at].key or 'its own operations'} in evaluation where training does not: "
            "give it as an nn.Sequential of blocks instead"
        )
    return parts


def cut(
    ops: list[fx.Node], weights: dict[str, int], target: int
) -> tuple[list[Segment], list[list[fx.Node]], list[str]]:
    """The segments of a graph's operations (``weights``: parameters per submodule), each one's operations with
    the shape computations placed, and the keys refined (to cut another graph alike)."""
    segments, refined = _cut([n for n in ops if not _is_shape(n)], weights, target)
    return segments, _with_shapes(ops, [s.nodes for s in segments]), refined


def cut_alike(ops: list[fx.Node], segments: list[Segment], refined: list[str]) -> list[list[fx.Node]]:
    """Another graph's operations, cut where ``segments`` cut the first."""
    other = _replay([n for n in ops if not _is_shape(n)], refined)
    return _with_shapes(ops, _align(segments, other))
